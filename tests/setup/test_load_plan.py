"""Engine construction plans the weight load once: the memory check measures the plan that
then loads (it once re-planned the load from the checkpoint's headers in both places)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from densa.engine.llm_engine import LLMEngine
from densa.model import loader
from densa.setup import builder, loading, memory_plan
from densa.setup.args import EngineArgs


def test_construction_plans_the_weight_load_once(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    planned: list[Path] = []
    checked: list[Any] = []

    def plan_load(model_dir: Path, *args: Any, **kwargs: Any) -> loader.LoadPlan:
        planned.append(model_dir)
        return real_plan(model_dir, *args, **kwargs)

    def check_memory(*args: Any, **kwargs: Any) -> Any:
        checked.append(real_check(*args, **kwargs))
        return checked[-1]

    real_plan, real_check = loader.plan_load, builder.check_memory
    for module in (loader, loading, memory_plan):
        monkeypatch.setattr(module, "plan_load", plan_load)
    monkeypatch.setattr(builder, "check_memory", check_memory)
    monkeypatch.delenv(memory_plan.SKIP_ENV, raising=False)
    engine = LLMEngine.from_args(EngineArgs(model=str(tiny_model_dir), num_kv_pages=80))
    assert planned == [tiny_model_dir]
    assert checked and checked[0] is not None  # the check ran, on that plan
    assert checked[0].weights.resident_bytes > 0
    assert engine.config.cache.num_pages == 80
