"""A request's progress (inferd.progress.SeqProgress): changed only by its named transitions, whose counters keep
their order through a turn, a refused op, a preemption, a forgotten sequence and a start over."""

from __future__ import annotations

import ast
from pathlib import Path

from inferd.progress import RequestStatus, SeqProgress
from shared.ops import OpResult

ROOT = Path(__file__).resolve().parent.parent
BS = 4
FIELDS = {name for name in SeqProgress.__dataclass_fields__}


def check(seq: SeqProgress) -> None:
    """The order the counters keep at every instant."""
    assert seq.committed <= seq.computed <= len(seq.tokens), seq
    assert seq.told <= len(seq.tokens), seq


def result(seq_id: int, blocks: list[int], committed: int, first: int = 0) -> OpResult:
    return OpResult(seq_id, "running", first, blocks, first + len(blocks), committed)


def test_a_turn_told_computed_and_grown_keeps_the_counters_in_order():
    seq = SeqProgress()
    assert not seq.held and seq.status is RequestStatus.WAITING
    seq.placed(result(7, [3, 4], committed=4), list(range(6)), BS)     # a hit of one whole block
    assert (seq.held, seq.status, seq.computed, seq.committed, seq.told, seq.summed) == \
        (True, RequestStatus.RUNNING, 4, 4, 6, 1)
    seq.wrote(2)
    seq.sampled(99)
    assert seq.tell() == [99] and seq.told == 7 and seq.tell() == []    # told once, not again
    seq.grew(result(7, [5], committed=6, first=2))
    assert list(seq.table) == [3, 4, 5] and seq.committed == 6
    check(seq)


def test_an_op_memd_refused_gives_back_what_it_told_and_summed():
    seq = SeqProgress()
    seq.placed(result(7, [3, 4, 5], committed=0), list(range(10)), BS)
    seq.wrote(10)
    seq.sampled(1)
    sent = seq.tell()
    seq.sums_sent(2)
    seq.untold(len(sent))
    seq.sums_refused(0)
    assert (seq.told, seq.summed) == (10, 0) and seq.tell() == [1]        # the next op sends it again
    check(seq)


def test_a_fork_child_s_own_token_is_not_yet_memd_s():
    child = SeqProgress(tokens=[1, 2, 3, 4, 5, 42])
    child.placed(result(9, [3, 8], committed=5), child.tokens, BS, told=5)
    assert child.tell() == [42] and child.computed == 5
    check(child)


def test_a_preempted_sequence_gives_its_pages_up_then_is_forgotten_or_starts_over():
    seq = SeqProgress()
    seq.placed(result(7, [3, 4], committed=0), list(range(8)), BS)
    seq.wrote(8)
    seq.preempting()
    assert seq.tell() == [] and seq.status is RequestStatus.PREEMPTED
    seq.pages_given_up()
    assert seq.held and list(seq.table) == []                 # memd keeps the sequence; the pages went
    seq.forgotten()
    assert not seq.held and seq.status is RequestStatus.PREEMPTED and seq.tokens == list(range(8))
    seq.started_over()
    assert (seq.status, seq.held, seq.tokens, seq.computed, seq.told, seq.committed, seq.summed) == \
        (RequestStatus.WAITING, False, [], 0, 0, 0, 0)
    seq.finished()
    assert seq.status is RequestStatus.FINISHED


def _writes_outside_progress() -> list[str]:
    """`x.seq.<field> = ...` (or +=) anywhere but inferd/progress.py: a change that skips the transitions."""
    found = []
    for path in sorted((ROOT / "inferd").rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        if rel == "inferd/progress.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), rel)):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, ast.AugAssign | ast.AnnAssign) else []
            for target in targets:
                for part in ast.walk(target):
                    if isinstance(part, ast.Attribute) and part.attr in FIELDS and \
                            isinstance(part.value, ast.Attribute) and part.value.attr == "seq":
                        found.append(f"{rel}:{part.lineno}: {ast.unparse(part)}")
    return found


def test_no_module_but_progress_sets_a_request_s_progress():
    assert _writes_outside_progress() == []
