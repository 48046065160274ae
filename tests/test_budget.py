"""CPU budget and the configured thread count (R2.3), against real cgroup-format files."""

from __future__ import annotations

import pytest

from tests.conftest import cgroup_v2_tree
from vllm_srun.runtime.budget import (
    THREADS_ENV,
    cgroup_cpus,
    configured_threads,
    cpu_budget,
    default_threads,
)
from vllm_srun.runtime.errors import ConfigError


def test_cgroup_v2_quota_is_read_from_the_process_cgroup(tmp_path):
    root, proc = cgroup_v2_tree(tmp_path, "/kubepods/pod1", {"/kubepods/pod1": "400000 100000"})
    assert cgroup_cpus(root, proc) == 4.0


def test_cgroup_v2_unlimited_is_no_quota(tmp_path):
    root, proc = cgroup_v2_tree(tmp_path, "/a", {"/a": "max 100000", "/": "max 100000"})
    assert cgroup_cpus(root, proc) is None


def test_cgroup_v2_tightest_ancestor_wins(tmp_path):
    root, proc = cgroup_v2_tree(tmp_path, "/a/b", {"/a/b": "max 100000", "/a": "150000 100000"})
    assert cgroup_cpus(root, proc) == 1.5


def test_cgroup_v1_quota_and_period(tmp_path):
    d = tmp_path / "sys" / "cpu,cpuacct" / "docker" / "c1"
    d.mkdir(parents=True)
    (d / "cpu.cfs_quota_us").write_text("300000\n")
    (d / "cpu.cfs_period_us").write_text("100000\n")
    proc = tmp_path / "cgroup"
    proc.write_text("12:memory:/docker/c1\n4:cpu,cpuacct:/docker/c1\n")
    assert cgroup_cpus(tmp_path / "sys", proc) == 3.0


def test_cgroup_v1_unlimited_quota(tmp_path):
    d = tmp_path / "sys" / "cpu,cpuacct"
    d.mkdir(parents=True)
    (d / "cpu.cfs_quota_us").write_text("-1\n")
    (d / "cpu.cfs_period_us").write_text("100000\n")
    proc = tmp_path / "cgroup"
    proc.write_text("4:cpu,cpuacct:/\n")
    assert cgroup_cpus(tmp_path / "sys", proc) is None


def test_missing_cgroup_files_mean_no_quota(tmp_path):
    assert cgroup_cpus(tmp_path / "nothing", tmp_path / "no-cgroup") is None


@pytest.mark.parametrize(("affinity", "quota", "budget"), [
    (64, 4.0, 4), (64, None, 64), (2, 8.0, 2), (8, 1.5, 1), (8, 0.5, 1)])
def test_budget_is_the_smaller_of_affinity_and_quota(affinity, quota, budget):
    assert cpu_budget(affinity, quota, read_cgroup=False) == budget


@pytest.mark.parametrize(("budget", "threads"), [(1, 1), (2, 1), (3, 1), (4, 2), (9, 4),
                                                 (32, 16), (64, 16)])
def test_default_is_half_the_budget_in_1_to_16(budget, threads):
    assert default_threads(budget) == threads


def test_env_overrides_and_is_capped_by_budget():
    assert configured_threads(8, env={THREADS_ENV: "3"}) == 3
    assert configured_threads(2, env={THREADS_ENV: "8"}) == 2
    assert configured_threads(8, env={}) == 4


def test_flag_wins_over_env_and_is_capped():
    assert configured_threads(8, flag=6, env={THREADS_ENV: "3"}) == 6
    assert configured_threads(4, flag=6, env={}) == 4


@pytest.mark.parametrize("bad", ["0", "-2", "abc", "2.5", " "])
def test_bad_env_value_is_an_error_naming_the_variable(bad):
    with pytest.raises(ConfigError, match=THREADS_ENV):
        configured_threads(8, env={THREADS_ENV: bad})
