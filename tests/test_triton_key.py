"""Triton's installation key kept across processes (``multihead.kernels._triton_key``): a
warm start must not hash Triton's 400+ MB library again, and must find the very kernels
Triton compiled under the key it computed itself."""

from __future__ import annotations

import builtins
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

from triton.runtime import cache  # noqa: E402

from multihead.kernels import _triton_key  # noqa: E402

KNOWN, REAL_KEY = _triton_key.known, cache.triton_key


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """A compiled (not interpreted) Triton over an empty cache folder, this process's key
    not yet installed, and a stand-in for Triton's hashing that counts its calls."""
    calls = []

    def hashing():
        calls.append(1)
        return "3.x-key-of-this-installation"

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("MULTIHEAD_TRITON_KEY_CACHE", raising=False)
    monkeypatch.setattr(_triton_key, "_DONE", False)
    monkeypatch.setattr(_triton_key, "known", lambda compute: True)   # the stand-in's source

    def new_process():                  # what a new process starts with
        monkeypatch.setattr(_triton_key, "_DONE", False)
        monkeypatch.setattr(cache, "triton_key", functools.lru_cache()(hashing))

    new_process()
    return calls, new_process, tmp_path / _triton_key.FILE


def test_the_fingerprint_covers_every_file_triton_hashes(monkeypatch):
    """Run Triton's own hashing with ``open`` watched: every file it reads must be in the
    fingerprint, or an edit to that file would leave a stale key in use."""
    import triton
    root = os.path.dirname(os.path.abspath(triton.__file__))
    read, real_open = [], builtins.open

    def watched(path, *args, **kwargs):
        read.append(os.path.relpath(os.path.abspath(path), root))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", watched)
    key = cache.triton_key.__wrapped__()             # Triton's hashing, not its memo
    monkeypatch.setattr(builtins, "open", real_open)
    covered = {row[0] for row in _triton_key.fingerprint(root)}
    assert key.startswith(triton.__version__) and len(read) > 20
    assert set(read) <= covered, sorted(set(read) - covered)
    assert any(p.startswith(os.path.join("_C", "libtriton")) for p in read)


def test_a_second_process_takes_the_kept_key_without_hashing(fresh):
    calls, new_process, kept = fresh
    _triton_key.install()
    assert calls == [1] and kept.exists()            # hashed once, and kept
    assert json.loads(kept.read_text())["key"] == "3.x-key-of-this-installation"
    _triton_key.install()                            # once per process
    assert calls == [1]
    new_process()
    _triton_key.install()
    assert cache.triton_key() == "3.x-key-of-this-installation" and calls == [1]


def test_a_changed_installation_is_hashed_again(fresh, monkeypatch):
    calls, new_process, kept = fresh
    _triton_key.install()
    real = _triton_key.fingerprint
    edited = lambda root: [[*row[:2], row[2] + 1, *row[3:]] if i == 0 else row   # noqa: E731
                           for i, row in enumerate(real(root))]
    monkeypatch.setattr(_triton_key, "fingerprint", edited)
    new_process()
    _triton_key.install()
    assert calls == [1, 1]                           # an edited file: Triton hashes again
    new_process()
    _triton_key.install()
    assert calls == [1, 1]                           # and the new fingerprint is kept


@pytest.mark.parametrize("damage", ["not json", "[1, 2]", '{"key": 5}', ""])
def test_a_damaged_file_is_replaced_not_trusted(fresh, damage):
    calls, new_process, kept = fresh
    kept.write_text(damage)
    _triton_key.install()
    assert calls == [1]
    assert json.loads(kept.read_text())["key"] == "3.x-key-of-this-installation"


def test_an_unwritable_cache_folder_leaves_triton_as_it_was(fresh, monkeypatch, tmp_path):
    calls, _, _ = fresh
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(blocker / "cache"))   # under a file: OSError
    _triton_key.install()
    assert calls == [1] and cache.triton_key() == "3.x-key-of-this-installation"


def test_a_triton_key_of_unread_source_is_left_to_triton(fresh, monkeypatch):
    """A Triton whose key function is not one read here (it may hash more than files) keeps
    computing its key, and nothing is kept; the function installed now is a known one."""
    calls, _, kept = fresh
    monkeypatch.setattr(_triton_key, "known", KNOWN)
    assert KNOWN(REAL_KEY) and not KNOWN(cache.triton_key)       # the stand-in is unknown
    _triton_key.install()
    assert calls == [] and not kept.exists()


@pytest.mark.parametrize("env", [("MULTIHEAD_TRITON_KEY_CACHE", "0"), ("TRITON_INTERPRET", "1")])
def test_off_and_under_the_interpreter_nothing_is_read_or_kept(fresh, monkeypatch, env):
    calls, _, kept = fresh
    monkeypatch.setenv(*env)
    _triton_key.install()
    assert calls == [] and not kept.exists()


#: compiles the decode kernel for sm_90 (launching nothing) over the cache folder argv[1];
#: prints whether Triton's own hashing ran and the folder's compiled entries
_COMPILE = """
import os, sys, torch
sys.path.insert(0, {tests!r})
from sm90_compile import stub_launches
from triton.runtime import cache
hashing = cache.triton_key
from multihead.kernels.decode import decode_forward
q = torch.zeros(1, 4, 1, 64, dtype=torch.float16)
kv = torch.zeros(1, 2, 256, 64, dtype=torch.float16)
with stub_launches():
    decode_forward(q, kv, kv, scale=0.125)
print(hashing.cache_info().currsize, cache.triton_key is hashing)
print(*sorted(d for d in os.listdir(sys.argv[1]) if not d.endswith(".json")))
"""


def test_a_warm_process_finds_the_kernels_triton_compiled_under_its_own_key(tmp_path):
    """Two processes over one cache folder: the first hashes and compiles, the second takes
    the kept key and compiles nothing (its lookups hit the first's entries, so the kept key
    is the one Triton computed)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), MULTIHEAD_TRITON_KEY_CACHE="1")
    code = _COMPILE.format(tests=str(Path(__file__).parent))
    runs = []
    for _ in range(2):
        run = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=env,
                             capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr[-4000:]
        runs.append(run.stdout.splitlines())
    (first, entries), (second, again) = runs
    assert first == "1 True"                         # hashed by Triton itself
    assert second == "0 False"                       # never hashed: the kept key served
    assert entries and again == entries              # nothing compiled the second time
