"""Every benchmark's --quick run: a bench that no longer runs fails here, not on the day its figures are needed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.processes


def quick(script: str, *args: str, env: dict[str, str] | None = None) -> dict:
    """The bench's figures: its --json object (the last line where a report comes first)."""
    done = subprocess.run([sys.executable, str(ROOT / "bench" / script), "--quick", "--json", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    try:
        return json.loads(done.stdout)
    except json.JSONDecodeError:
        return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def memd_bench() -> dict:
    return quick("bench_memd.py")


def assert_the_memd_bench_ran(report: dict) -> None:
    """All of it but the comparison with vLLM's allocator, which needs vLLM's wheel (from the network, once)."""
    assert report["manager_blocks_per_s"] > 0 and report["journal_max_rewrite_flush_ms"] > 0
    assert report["step_rate_ratio_vs_echo"] > 0 and report["step_rate_ratio_vs_stream_echo"] > 0
    assert report["check_1m_max_step_wait_ms"] > 0 and report["snapshot_1m_max_step_wait_ms"] > 0
    assert report["operator"]["snapshot"]["memd_holds"] > 0 and report["operator"]["check"]["memd_holds"] > 0
    assert report["snapshot_1m_memd_hold_under_ms"] > 0 and report["check_1m_memd_hold_under_ms"] > 0
    assert [run["clients"] for run in report["step_rpc"]] == [1, 2] and report["reclaim_ms"]
    # both collector policies collected while 10k sessions came, and memd served its own collections' figures
    assert report["full_collections"]["memd"]["full_collections"] >= 1 and report["full_collection_longest_ms"] > 0
    assert report["full_collections"]["python"]["full_collections"] >= 1
    # with every session freed, memd's freezing policy leaves the process no bigger than Python's own collector
    fc = report["full_collections"]
    assert fc["memd"]["rss_after_mib"] <= 1.05 * fc["python"]["rss_after_mib"]
    assert report["operator"]["memd_longest_full_collection_ms"] >= 0


def test_the_memd_bench_runs(memd_bench):
    assert_the_memd_bench_ran(memd_bench)


def test_the_memd_bench_measures_its_allocator_against_vllms(memd_bench):
    unavailable = memd_bench["allocator"].get("vllm_unavailable")
    if unavailable is not None:
        pytest.skip(f"no vLLM wheel to compare with ({unavailable}): bench/vllm_anchor.py downloads it once, "
                    "into ~/.cache/kvpool-bench (or $XDG_CACHE_HOME/kvpool-bench)")
    assert memd_bench["alloc16_ratio_vs_vllm"] > 0 and memd_bench["free16_ratio_vs_vllm"] > 0


def test_the_memd_bench_runs_without_vllms_wheel(tmp_path):
    offline = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), "PIP_NO_INDEX": "1", "PIP_CONFIG_FILE": os.devnull}
    report = quick("bench_memd.py", env=offline)
    assert report["allocator"]["vllm_unavailable"].startswith("pip download vllm==")
    assert not [key for key in report if key.endswith("_ratio_vs_vllm")]
    assert_the_memd_bench_ran(report)


def test_the_swap_bench_runs():
    report = quick("bench_swap.py")
    assert report["bandwidth"] and report["steps"]
    assert report["swap_min_ratio"] > 0 and report["storm_p99_ratio"] > 0 and report["storm_p99_ratio_vs_busy"] > 0
    assert report["swap_checked_min_ratio"] > 0
    # memd's real path moved every page to its place and back, each hash the pool's own
    assert all(b["checked_round_trip_exact"] for rows in report["bandwidth"].values() for b in rows)
    assert all(report["steps"][mode]["steps"] > 0 for mode in ("quiet", "busy", "storm"))
    assert report["steps"]["storm_swaps"]["swap_outs"] > 0
    long = report["long_session"]          # both kinds of resume ran, and the probe saw each phase
    assert set(long["phases"]) == {"swap-out", "resume, pages cached", "resume, pages reused"}
    assert all(phase["probe_max_ms"] > 0 for phase in long["phases"].values())


def test_the_served_inferd_bench_runs():
    report = quick("bench_inferd.py", "--served")
    assert report["decode_b1_ratio_vs_hf"] > 0 and report["decode_b16_ratio_vs_hf_padded"] > 0
    assert all(run["inferd_full_collections"] >= 0 for run in report["served"])     # inferd's metrics, scraped
    assert all(run["inferd_decode_passes"] > 0 and run["inferd_decode_pass_ms"] > 0 for run in report["served"])
    # both decoded greedily on the same weights: a server computing something else fails here, not only slower
    assert all(run["agreement"] == 1.0 for run in report["served"])


def test_the_inferd_bench_runs():
    report = quick("bench_inferd.py")
    assert report["quick"] and report["kvpool_b1_decode"] > 0 and report["hf_b1_decode"] > 0
    mixed = report["mixed_pass"]
    assert min(mixed["decode_ms"], mixed["chunk_ms"], mixed["mixed_ms"]) > 0 and report["mixed_pass_ratio"] > 0
    shares = mixed["decode_shares"]
    assert set(shares) == {"matmul", "kv_gather", "attention", "other"}
    assert min(shares["matmul"], shares["attention"]) > 0
    if mixed["attention"] == "paged":          # read from the pages: nothing gathered, and the gathering pass timed
        assert shares["kv_gather"] == 0 and mixed["decode_gather_ms"] > 0
    else:
        assert shares["kv_gather"] > 0
    if mixed["weight_layout"] != "checkpoint":  # and again with the weights as the checkpoint lays them out
        assert mixed["decode_unpacked_ms"] > 0
    if mixed["fused"]:                         # and again with torch's ops for the norms, RoPE and K/V store
        assert mixed["decode_unfused_ms"] > 0


def test_the_http_chat_bench_runs_and_only_its_reuse_runs_reuse():
    report = quick("bench_http_chat.py")
    runs = report["runs"]
    assert set(runs) == {"no reuse", "prefix cache", "session"}
    assert runs["no reuse"]["cached_share_later"] == 0
    assert runs["prefix cache"]["cached_share_later"] > 0.5 and runs["session"]["cached_share_later"] > 0.5
    assert all(r["output_tok_s"] > 0 for r in runs.values())


def test_the_verification_cost_bench_runs():
    report = quick("bench_verify.py")
    assert report["on"]["decode_tok_s"] > 0 and report["off"]["decode_tok_s"] > 0
    assert report["on"]["sum_share"] > report["off"]["sum_share"]     # the switch switched


def test_the_cluster_bench_runs_and_only_the_store_run_reads_a_lost_host_from_the_store():
    if not (Path(sys.executable).parent / "mooncake_master").exists():
        pytest.skip("kvpool[cluster] is not installed")
    runs = quick("bench_cluster.py")["runs"]
    routed, alone, plain = runs["kvroute + store"], runs["kvroute, no store"], runs["round robin, no store"]
    assert routed["cached_share_later"] > 0.5 and routed["moved_sessions"] >= 1
    assert routed["cached_share_moved"] > 0.5 and alone["cached_share_moved"] < 0.2 and alone["moved_sessions"]
    assert routed["fetch"]["store_64k_gib_s"] > 0 and routed["fetch"]["tcp_gib_s"] > 0
    assert plain["cached_share_later"] < routed["cached_share_later"]
    assert runs["session hash, no store"]["cached_share_later"] > 0.5        # a sticky balancer finds its sessions


def test_the_gpu_decode_bench_runs_on_the_cpu(tmp_path):
    # Its figures need a GPU (bench/gpu_check.sh runs it there); here the same harness runs a tiny checkpoint,
    # and its profile windows (py-spy's only where it is installed).
    report = quick("bench_gpu_decode.py", "--device", "cpu", "--pool", "256MiB", "--profile", str(tmp_path))
    profile = (tmp_path / "profile_b1.txt").read_text()
    assert "aten::" in profile and "ops cover" in profile and (tmp_path / "profile_b4.json.gz").stat().st_size
    assert report["decode_b1_ratio_vs_hf"] > 0 and report["decode_b4_ratio_vs_hf"] > 0
    assert report["kvpool_turn2_ttft_ms"] > 0 and report["hf_turn2_ttft_ms"] > 0
    read = report["page_read"]
    assert read["argmax_agree_4"] == 1.0 and read["max_logit_diff_4"] < 1e-3     # fp32: the same attention


def test_the_route_bench_runs_and_routes_by_the_pools_blocks_only_with_kv_events():
    report = quick("bench_route.py")
    text, kv = report["runs"]["text"], report["runs"]["kv"]
    assert not any(key.endswith(" kv") for key in text["routed"])               # no events: the text rule
    assert sum(v for key, v in kv["routed"].items() if key.endswith(" kv")) > 0
    assert 0 <= text["cached_share"] <= 1 and 0 < kv["cached_share"] <= 1
    assert text["ttft_p50_ms"] > 0 and kv["ttft_p50_ms"] > 0


@pytest.mark.timeout(600)
def test_aiperf_and_inference_perf_run_against_inferd_and_kvroute_without_a_failed_request():
    # aiperf and inference-perf come from the venvs `.ci/run` set up (bench/load_tools.py), or are set up here.
    report = quick("bench_load_tools.py")
    assert report["failed"] == 0
    runs = report["runs"]
    assert set(runs) == {f"kvroute {tool}" for tool in ("aiperf", "inference-perf shared_prefix",
                                                        "inference-perf sharegpt", "bench_http_chat")}
    assert all(r["ok"] > 0 and r["exit"] == 0 and r["ttft_p50_ms"] > 0 for r in runs.values())
    assert runs["kvroute aiperf"]["server_metrics"] and runs["kvroute aiperf"]["cached_share"] > 0


@pytest.mark.timeout(600)          # two vLLM starts (~50 s each on 2 cores) and two of kvpool
def test_the_peer_bench_runs_both_servers_and_they_decode_the_same_tokens():
    # vLLM comes from the venv `.ci/run` set up (bench/peer_engines.py), or is set up here on first use.
    report = quick("bench_peer.py")
    assert report["peer_greedy_agreement"] == 1.0          # same weights, both float32, both greedy
    run = report["runs"][0]
    for engine in ("kvpool", "vLLM"):
        assert run[engine]["chat"]["cached_share_later"] > 0.5          # both found the conversation's prefix
        assert run[engine]["pressure"]["output_tok_s"] > 0
    keys = ("chat_ttft1", "chat_ttft2", "chat_wall", "pressure_ttft1", "pressure_ttft2", "pressure_ttft2_p99",
            "decode_b1", "decode_b16", "pressure_itl_p99")
    assert all(0 < report[f"peer_{key}_ratio"] < float("inf") for key in keys)


@pytest.mark.timeout(600)          # four vLLM starts (~35 s each on 2 cores) and a memd
def test_the_vllm_memd_bench_loads_a_restarted_vllms_conversations_from_memd_with_the_same_replies():
    report = quick("bench_vllm_memd.py")
    run = report["runs"][0]
    # The replies with memd as without: a reply whose prompt vLLM alone recomputes and memd's engine loads may
    # differ by a near-tie of the random tiny model (K/V written by decode steps against one prefill), one at
    # most; K/V loaded wrong turns nearly every reply after it. (tests/test_vllm_memd.py checks token for token.)
    assert report["vllm_memd_agreement"] >= 0.85
    # restarted alone, vLLM recomputes every conversation (but the system prompt the first user's turn put back);
    # with memd, the conversations come back
    assert run["alone"]["restart"]["cached_share_later"] < 0.5 < run["memd"]["restart"]["cached_share_later"]
    assert run["memd"]["steady"]["cached_share_later"] > 0.5 and report["cpu"]
    assert all(0 < report[key] < float("inf") for key in ("vllm_memd_overhead_ttft_ratio",
                                                          "vllm_memd_overhead_tok_s_ratio",
                                                          "vllm_memd_restart_ttft2_ratio"))


def test_the_tenants_bench_runs_and_only_the_guarantee_keeps_the_quiet_tenants_sessions():
    report = quick("bench_tenants.py")
    runs = report["runs"]
    assert runs["noisy, guaranteed"]["cached_share_later"] == runs["alone"]["cached_share_later"] > 0.5
    assert runs["noisy, no quota"]["cached_share_later"] < runs["noisy, guaranteed"]["cached_share_later"]
    assert runs["noisy, guaranteed"]["noisy_output_tokens"] > 0 and runs["alone"]["noisy_output_tokens"] == 0


def test_the_scale_bench_runs_and_each_evicting_step_evicts_and_a_restart_brings_every_session_back():
    report = quick("bench_scale.py")
    for size, row in report["sizes"].items():
        assert row["evictions"] == row["evicting_steps"]           # every evicting Step did evict, one each
        assert row["parked_after_restart"] == row["parked"] == int(size)      # kill -9 lost no parked session
        assert row["events_seen"] == row["evicting_steps"]         # each new session's blocks were announced
        assert row["bytes_per_session"] > 0 and row["recovery_first_step_s"] > 0
    assert report["scale_step_p99_growth"] > 0 and report["scale_bytes_per_page"] > 0
