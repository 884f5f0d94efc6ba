"""The cluster secret, the router's placement token and the KV link's MACs: exact behaviour."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from densa.auth.frames import LinkKeys, new_nonce
from densa.auth.placement import PlacementError, PlacementVerifier, sign_placement
from densa.auth.secret import SECRET_ENV, ClusterSecret, SecretError, load_secret

SECRET = ClusterSecret(b"0123456789abcdef0123456789abcdef")
URL = "http://10.0.0.5:8001"


def test_keys_differ_by_purpose_and_by_secret() -> None:
    other = ClusterSecret(b"another-secret-of-enough-bytes!!")
    assert SECRET.key("placement") != SECRET.key("kv-link")
    assert SECRET.key("placement") != other.key("placement")
    assert len(SECRET.key("kv-link")) == 32


def test_a_short_secret_is_refused_and_the_secret_never_prints() -> None:
    with pytest.raises(SecretError, match="at least 16"):
        ClusterSecret(b"short")
    assert "0123456789abcdef" not in repr(SECRET)


def test_the_secret_file_is_written_owner_only_and_read_back(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    secret = ClusterSecret.generate()
    old_umask = os.umask(0)  # the mode is set on the descriptor, whatever the umask
    try:
        secret.write(path)
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_secret(str(path)) == secret


def test_the_secret_is_never_written_into_a_planted_file_or_through_a_symlink(
    tmp_path: Path,
) -> None:
    """What another user plants where the secret goes gets nothing: an existing file stays as
    it was, and a symlink is not followed to the file it names."""
    planted = tmp_path / "planted"
    planted.write_text("theirs")
    os.chmod(planted, 0o644)
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "target-they-read")
    secret = ClusterSecret.generate()
    for path in (planted, link):
        with pytest.raises(SecretError, match="exists already"):
            secret.write(path)
    assert planted.read_text() == "theirs" and stat.S_IMODE(planted.stat().st_mode) == 0o644
    assert not (tmp_path / "target-they-read").exists()


def test_load_secret_takes_the_file_then_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(SECRET_ENV, raising=False)
    assert load_secret(None) is None
    monkeypatch.setenv(SECRET_ENV, "from-the-environment-0123456789")
    assert load_secret(None) == ClusterSecret(b"from-the-environment-0123456789")
    with pytest.raises(SecretError, match="cannot read"):
        load_secret(str(tmp_path / "missing"))


def test_a_signed_placement_verifies_only_for_its_url_and_until_it_expires() -> None:
    now = [1_000_000.0]
    token = sign_placement(SECRET, URL, ttl_s=30, clock=lambda: now[0])
    verifier = PlacementVerifier(SECRET, clock=lambda: now[0])
    verifier.verify(token, URL)
    verifier.verify(token, URL)  # a retry of the same request resends it
    with pytest.raises(PlacementError) as moved:
        verifier.verify(token, "http://evil:1")
    assert moved.value.reason == "bad_signature"
    now[0] += 31
    with pytest.raises(PlacementError) as late:
        verifier.verify(token, URL)
    assert late.value.reason == "expired"


@pytest.mark.parametrize(
    "token",
    ["", "v1", "v2.abc.99999999999.00", "v1.a-b.1.x", "v1.ab.12x." + "0" * 64, "v1." * 200,
     # Text str.isdigit() / isalnum() accept, which int() and compare_digest did not (a 500):
     "v1.ab.\u00b2." + "0" * 64, "v1.ab.\u0661\u0662." + "0" * 64, "v1.\u00e9b.12." + "0" * 64,
     "v1.ab.12." + "\u00e9" * 64, "v1.ab.12." + "0" * 63 + "\u00ff", "v1.ab.12." + "A" * 64,
     "v1.ab.12." + "0" * 64 + "\n"],
)  # fmt: skip
def test_malformed_tokens_are_refused_without_repeating_them(token: str) -> None:
    with pytest.raises(PlacementError) as info:
        PlacementVerifier(SECRET).verify(token, URL)
    assert info.value.reason == "malformed"
    assert token[:20] not in str(info.value) or not token


def test_a_token_signed_with_another_secret_or_edited_is_refused() -> None:
    forged = sign_placement(ClusterSecret(b"not-the-cluster-secret-at-all!!!"), URL)
    with pytest.raises(PlacementError, match="bad_signature"):
        PlacementVerifier(SECRET).verify(forged, URL)
    version, placement_id, expiry, mac = sign_placement(SECRET, URL).split(".")
    later = f"{version}.{placement_id}.{int(expiry) + 3600}.{mac}"
    with pytest.raises(PlacementError, match="bad_signature"):
        PlacementVerifier(SECRET).verify(later, URL)


def test_frame_macs_bind_the_session_the_direction_and_every_byte() -> None:
    keys = LinkKeys(SECRET)
    nonce_d, nonce_p = new_nonce(), new_nonce()
    session = keys.session(nonce_d, nonce_p)
    frames = [b"header", memoryview(b"page bytes")]
    sealed = [*frames, session.to_prefill.seal(frames)]
    assert session.to_prefill.verify(sealed)
    assert not session.to_decode.verify(sealed)  # reflected back: another direction
    assert not keys.session(nonce_d, new_nonce()).to_prefill.verify(sealed)  # another session
    other_cluster = LinkKeys(ClusterSecret.generate())
    assert not other_cluster.session(nonce_d, nonce_p).to_prefill.verify(sealed)
    damaged = [b"header", b"page bytez", sealed[-1]]
    assert not session.to_prefill.verify(damaged)
    # Frame boundaries count: the same bytes split differently are another message.
    assert not session.to_prefill.verify([b"headerpage", b" bytes", sealed[-1]])
    assert not session.to_prefill.verify([sealed[-1]])
