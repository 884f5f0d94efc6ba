"""Re-save a BF16 checkpoint's linear weights as DeepSeek-style FP8 (e4m3 + 128x128 weight_scale_inv)."""
import json, re, shutil, sys
from pathlib import Path
import torch
from safetensors.torch import load_file, save_file
from densa.quant.fp8_weights import quantize_blocks

src, dst = Path(sys.argv[1]), Path(sys.argv[2])
shutil.copytree(src, dst, dirs_exist_ok=True)
linear = re.compile(r"\.(q|k|v|o|gate|up|down)_proj\.weight$")
out = {}
for name, t in load_file(str(src / "model.safetensors")).items():
    if linear.search(name):
        parts = quantize_blocks(t.float(), 128)
        out[name] = parts["weight"]
        out[name.removesuffix(".weight") + ".weight_scale_inv"] = parts["scale"]
    else:
        out[name] = t
save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
cfg = json.loads((dst / "config.json").read_text())
cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
(dst / "config.json").write_text(json.dumps(cfg, indent=2))
print("wrote", dst)
