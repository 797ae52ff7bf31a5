"""Host memory within the process's limits: a container's cgroup and ``ulimit -v`` bound
what auto prices with and what a buffer may take, not the machine's RAM."""

import os
import subprocess
import sys
import textwrap

import pytest

from multihead import _host_memory

GiB = 2**30


def _tree(tmp_path, proc_line: str, files: dict[str, str]):
    """A fake ``/proc/self/cgroup`` and cgroup hierarchy under ``tmp_path``."""
    proc = tmp_path / "cgroup"
    proc.write_text(proc_line + "\n")
    for rel, text in files.items():
        path = tmp_path / "sys" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return str(proc), str(tmp_path / "sys")


def test_a_v2_limit_on_an_ancestor_binds_and_inactive_page_cache_counts_as_free(tmp_path):
    proc, root = _tree(tmp_path, "0::/kube/pod/ctr", {
        "kube/memory.max": "max\n", "kube/memory.current": f"{40 * GiB}\n",
        "kube/pod/memory.max": f"{4 * GiB}\n", "kube/pod/memory.current": f"{3 * GiB}\n",
        "kube/pod/memory.stat": f"anon {2 * GiB}\ninactive_file {GiB}\n",
        "kube/pod/ctr/memory.max": "max\n", "kube/pod/ctr/memory.current": f"{3 * GiB}\n",
    })
    assert _host_memory.cgroup_limit(proc, root) == (4 * GiB, 2 * GiB)


def test_a_v1_memory_controller_is_read_and_its_unlimited_root_ignored(tmp_path):
    proc, root = _tree(tmp_path, "9:pids:/x\n4:cpu,memory:/job\n0::/", {
        "memory/memory.limit_in_bytes": "9223372036854771712\n",
        "memory/memory.usage_in_bytes": f"{9 * GiB}\n",
        "memory/job/memory.limit_in_bytes": f"{2 * GiB}\n",
        "memory/job/memory.usage_in_bytes": f"{GiB + GiB // 2}\n",
        "memory/job/memory.stat": f"cache 5\ntotal_inactive_file {GiB // 4}\n",
    })
    assert _host_memory.cgroup_limit(proc, root) == (2 * GiB, GiB - GiB // 4)


def test_a_namespaced_cgroup_is_read_at_the_mounts_root(tmp_path):
    """In a container's cgroup namespace the path may name a directory that is not there
    (the container's own cgroup is the mount's root)."""
    proc, root = _tree(tmp_path, "0::/not/here", {"memory.max": f"{GiB}\n",
                                                   "memory.current": f"{GiB // 4}\n"})
    assert _host_memory.cgroup_limit(proc, root) == (GiB, 3 * GiB // 4)


def test_no_cgroup_limit_is_none(tmp_path):
    proc, root = _tree(tmp_path, "0::/a", {"a/memory.max": "max\n", "a/memory.current": "7\n"})
    assert _host_memory.cgroup_limit(proc, root) is None
    assert _host_memory.cgroup_limit(str(tmp_path / "missing"), root) is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="rlimits and /proc: Linux")
def test_under_ulimit_v_auto_runs_a_plan_that_fits_and_a_cache_past_it_is_refused():
    """The machine's RAM was the CPU profile's memory: under ``ulimit -v`` auto chose plans
    whose scratch the process could not map (an allocation error deep in torch)."""
    script = textwrap.dedent("""
        import resource
        import torch, multihead as mh

        def mapped():
            for line in open("/proc/self/status"):
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024

        torch.set_num_threads(1)
        limit = mapped() + 2 * 2**30
        resource.setrlimit(resource.RLIMIT_AS, (limit, resource.RLIM_INFINITY))
        free = mh._device.free_memory(torch.device("cpu"))
        assert 0 < free <= 2 * 2**30, free
        assert mh.profiles.profile_for("cpu").memory <= 2 * 2**30
        S = 16384
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, 4, S, 8, generator=g) for _ in range(3))
        m = mh.masks.causal() & mh.masks.padding(torch.tensor([S - 7]))
        text = str(mh.explain(q, k, v, mask=m))
        assert "reference    cannot run: needs 12.0 GiB of scratch memory" in text, text
        out = mh.attention(q, k, v, mask=m)                       # auto, within the limit
        rows = slice(S - 64, S)                                   # the last queries, by hand
        s = (q[:, :, rows] @ k.transpose(-1, -2)) * 8 ** -0.5     # (1, 4, 64, S)
        keep = torch.arange(S) <= torch.arange(S - 64, S)[:, None]
        keep &= torch.arange(S) < S - 7
        want = s.masked_fill(~keep, float("-inf")).softmax(-1) @ v
        torch.testing.assert_close(out[:, :, rows], want, atol=1e-5, rtol=1e-4)
        try:
            mh.KVCache(64, 4096, 8, 128)                          # 2 GiB of slots
        except ValueError as e:
            assert "but cpu has" in str(e) and "free" in str(e), e
        else:
            raise AssertionError("a cache past the limit was allocated")
        print("ok")
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=300, env=env)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stdout + run.stderr
