"""Prefill/decode disaggregation in the lab: the client playing the decode pod's
sidecar (exact virtual times), its fallback, a P/D fleet run by llm-d-pd.yaml, time
per output token, the RAG workload and bad input."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from bench.__main__ import main
from bench.lab.epp import Delays
from bench.lab.loop import EventLoop
from bench.lab.pod import LabPod
from bench.lab.run import FleetSpec, LabOptions, LabRun, Routed, run_lab
from bench.lab.workload import LabSession, LabTurn, LabWorkload
from bench.workloads import Words, WorkloadSpec, default_tokenizer_dir, rag
from epp.clock import VirtualClock
from epp.scheduling.types import Usage
from sim.engine import EngineConfig
from sim.kv_events import KVEvent
from sim.latency import LatencyModel, StepChunk

MODEL = LatencyModel()
B = 16


class Fixed:
    """A router sending every request to `decode`, its prefill to `prefill` (None:
    whole), with the lab's route delay."""

    def __init__(self, decode: LabPod, prefill: LabPod | None, route_s: float) -> None:
        self.decode = decode
        self.prefill = prefill
        self.route_delay_s = route_s
        self.ttft_predictions: list[tuple[float, float]] = []
        self.firsts = 0
        self.ends: list[tuple[Usage | None, bool]] = []

    @property
    def wants_events(self) -> bool:
        return False

    def on_events(self, pod: LabPod, events: Sequence[KVEvent]) -> None:
        pass

    def route(
        self,
        request_id: str,
        body: bytes,
        prompt: Sequence[int],
        headers: Mapping[str, str],
        done: Callable[[Routed], None],
    ) -> None:
        done((self.decode, request_id))

    def prefill_pod(self, handle: Any) -> LabPod | None:
        return self.prefill

    def first_token(self, handle: Any) -> None:
        self.firsts += 1

    def end(self, handle: Any, usage: Usage | None, completed: bool) -> None:
        self.ends.append((usage, completed))

    def close(self) -> None:
        pass

    def describe(self) -> dict[str, Any]:
        return {}


PROMPT = list(range(1000, 1100))  # 100 tokens: 6 full blocks


def one_request(
    prefill_config: EngineConfig | None = None, output: int = 5
) -> tuple[LabRun, Fixed, LabPod, LabPod]:
    loop = EventLoop(VirtualClock(0.0))
    config = EngineConfig(block_size=B, hash_seed="0")
    prefill = LabPod(0, prefill_config or config, [7, 8, 9], loop, MODEL, role="prefill")
    decode = LabPod(1, config, [7, 8, 9], loop, MODEL, role="decode")
    delays = Delays()
    router = Fixed(decode, prefill, delays.route_s)
    turn = LabTurn(output, len(PROMPT), lambda: (b"{}", list(PROMPT)))
    workload = LabWorkload("one", {}, [LabSession(0, 0, [turn])])
    fleet = FleetSpec(2, delays=delays, prefill_pods=1)
    run = LabRun(router, [prefill, decode], loop, fleet, workload, [0.0])
    run.start()
    loop.run()
    return run, router, prefill, decode


def test_the_client_sends_the_prefill_leg_then_the_decode_leg_and_times_the_first_token() -> None:
    run, router, prefill, decode = one_request()
    d = Delays()
    (record,) = run.records
    assert record.ok
    assert record.pod == "pod-1"
    # Route to the decode pod's sidecar; the prefill leg on the prefill pod (its
    # overhead, the whole prompt, its answer back); the decode leg on the decode pod
    # (its overhead, the transfer of 96 tokens, the 4 tokens left), the first token back.
    overhead = d.pod_overhead_s + d.pod_overhead_per_token_s * 100
    expected = (
        d.route_s
        + overhead
        + MODEL.step_time([StepChunk(100, 0)])
        + d.response_s
        + overhead
        + MODEL.kv_transfer_time(96)
        + MODEL.step_time([StepChunk(4, 96)])
        + d.response_s
    )
    assert record.ttft_s == pytest.approx(expected, rel=1e-12)
    # From the pods' own counters: the prefill pod served a one-token prefill leg,
    # the decode pod pulled 6 blocks and generated the answer.
    p, dec = prefill.core.stats, decode.core.stats
    assert (p.prefill_legs, p.requests_received, p.generation_tokens) == (1, 1, 1)
    assert (dec.decode_legs, dec.prefill_legs, dec.generation_tokens) == (1, 0, 5)
    assert dec.nixl_xfer_time.count == 1
    assert dec.external_prefix_cache_hits == 96
    assert run.pd_requests == 1
    assert run.pd_fallbacks == 0
    assert router.firsts == 1
    assert router.ends == [(Usage(100, 5, 0), True)]
    # Time per output token: 4 decode steps between the first and the last token.
    (tpot,) = run.tpots
    assert tpot == pytest.approx(MODEL.step_time([StepChunk(1, 101)]), rel=0.05)


def test_a_prefill_leg_the_prefill_pod_cannot_take_is_prefilled_on_the_decode_pod() -> None:
    # A prefill pod whose pool holds 64 tokens: the 100-token prompt does not fit.
    small = EngineConfig(block_size=B, hash_seed="0", num_gpu_blocks=5)
    run, _, prefill, decode = one_request(small)
    (record,) = run.records
    assert record.ok
    assert run.pd_requests == 1
    assert run.pd_fallbacks == 1
    assert prefill.core.stats.requests_received == 0
    assert decode.core.stats.decode_legs == 0
    assert decode.core.stats.prefix_cache_queries == 100
    assert decode.core.stats.nixl_xfer_time.count == 0


def test_a_fleet_needs_a_decode_pod_and_labels_its_roles() -> None:
    with pytest.raises(ValueError, match="decode pod"):
        FleetSpec(2, prefill_pods=2)
    with pytest.raises(ValueError, match="decode pod"):
        FleetSpec(2, prefill_pods=-1)
    fleet = FleetSpec(3, prefill_pods=1)
    assert [fleet.role(i) for i in range(3)] == ["prefill", "decode", "decode"]
    assert FleetSpec(3).role(0) is None


def test_a_pd_fleet_runs_llm_d_pd_yaml_and_its_prefill_pods_serve_prefill_legs(
    tmp_path: Path, qwen_words: Words
) -> None:
    small = {"groups": 4, "prompts_per_group": 8, "system_len": 256, "question_len": 64}
    options = LabOptions(
        workload=WorkloadSpec("shared-prefix", options=small | {"output_len": 16}),
        policies=("manifests/config/llm-d-pd.yaml", "default"),
        fleet=FleetSpec(4, prefill_pods=1),
        seeds=(0,),
        load=0.5,
        rate=None,
        tokenizer=default_tokenizer_dir(),
        out=tmp_path,
        command="test",
    )
    document = run_lab(options)
    pd = document["policies"]["llm-d-pd"]
    (result,) = pd["runs"]
    assert result["status"] == "ok"
    assert result["errors"] == 0
    assert result["requests"] == 32
    counts = result["pd"]
    assert counts["roles"] == {
        "pod-0": "prefill",
        "pod-1": "decode",
        "pod-2": "decode",
        "pod-3": "decode",
    }
    # Every question is 64 uncached tokens (>= the config's nonCachedTokens 16): every
    # request was disaggregated, its prefill on the prefill pod, its decode elsewhere.
    assert counts["disaggregated"] == 32
    assert counts["fallbacks"] == 0
    assert counts["prefill_legs_per_pod"] == {"pod-0": 32, "pod-1": 0, "pod-2": 0, "pod-3": 0}
    assert counts["decode_legs_per_pod"]["pod-0"] == 0
    assert sum(counts["decode_legs_per_pod"].values()) == 32
    assert counts["kv_transfers"] == 32
    assert counts["kv_transfer_mean_s"] > MODEL.kv_transfer_latency_s
    # The decode filter never picks the prefill pod: it served prefill legs only.
    assert result["load_per_pod"]["pod-0"] == 32
    assert result["tpot_p50_s"] is not None
    # An aggregated policy on the same fleet never disaggregates.
    (default,) = document["policies"]["default"]["runs"]
    assert default["pd"]["disaggregated"] == 0
    assert sum(default["pd"]["prefill_legs_per_pod"].values()) == 0
    report = (tmp_path / "report.md").read_text()
    assert "Prefill/decode fleet: 1 prefill pods, 3 decode pods" in report
    assert "- llm-d-pd: 32 disaggregated, 32 prefill legs served, 32 KV transfers" in report
    assert document["setup"]["prefill_pods"] == 1


def test_an_aggregated_run_reports_time_per_output_token(tmp_path: Path, qwen_words: Words) -> None:
    options = LabOptions(
        workload=WorkloadSpec("no-reuse", options={"requests": 16, "question_len": 64}),
        policies=("round-robin",),
        fleet=FleetSpec(2),
        seeds=(0,),
        load=0.3,
        rate=None,
        tokenizer=default_tokenizer_dir(),
        out=tmp_path,
        command="test",
    )
    document = run_lab(options)
    (result,) = document["policies"]["round-robin"]["runs"]
    assert "pd" not in result
    # 256-token answers on a lightly loaded pod: a decode step of a few ms each.
    assert 0.005 < result["tpot_p50_s"] <= result["tpot_p90_s"] < 0.05
    assert document["policies"]["round-robin"]["tpot_p50_s"] == result["tpot_p50_s"]
    assert "TPOT p50 ms" in (tmp_path / "report.md").read_text()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--pods", "2", "--prefill-pods", "2"], "--prefill-pods"),
        (["--pods", "2", "--prefill-pods", "-1"], "--prefill-pods"),
        (["--workload", "shared-prefix", "--documents", "3"], "--documents"),
        (["--workload", "rag", "--document-len", "8", "--groups", "2"], "--groups"),
    ],
)
def test_bad_pd_and_rag_flags_are_refused(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert main(["lab", "--no-progress", "--out", str(tmp_path), *flags]) == 2
    assert message in capsys.readouterr().err


def test_the_rag_workload_has_long_shared_documents_and_short_answers(
    builtin_words: Words,
) -> None:
    workload = rag(builtin_words, documents=8, requests=200, document_len=300, seed=3)
    assert workload.name == "rag"
    assert workload.num_requests == 200
    groups = [s.group for s in workload.sessions]
    # Popular documents recur: document 0 (weight 1) most of all.
    assert max(set(groups), key=groups.count) == 0
    assert len(set(groups)) <= 8
    (turn,) = workload.sessions[0].turns
    assert turn.max_tokens == 32
    (system, system_text), (user, user_text) = turn.messages
    assert (system, user) == ("system", "user")
    assert len(system_text.split(" ")) - 1 == 64
    assert len(user_text.split(" ")) - 1 == 300 + 32
    # Requests on the same document share its text, then differ in the question.
    same = [s for s in workload.sessions if s.group == workload.sessions[0].group]
    texts = [s.turns[0].messages[1][1] for s in same]
    assert all(t.startswith(texts[0][:1000]) for t in texts)
    assert len(set(texts)) == len(texts)
    # The same seed, the same requests.
    again = rag(builtin_words, documents=8, requests=200, document_len=300, seed=3)
    assert again == workload
    with pytest.raises(ValueError, match="document"):
        rag(builtin_words, documents=0)
