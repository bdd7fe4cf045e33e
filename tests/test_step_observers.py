"""A committed Step reaches memd's Step observers (the cluster tier publishes parked sessions from them)
whichever way its page effects settled: inline on the loop (a decode Step: a few pages zeroed) or queued
on the copier (a swap-in, a large effect). No processes: memd's parts in this process."""

from __future__ import annotations

from shared.ops import Extend, Open, Park, Resume

FLAGS = ("--pool-bytes", "1MiB", "--block-bytes", "4KiB", "--free-watermark", "0")


async def test_every_committed_step_reaches_the_observers_inline_or_queued(local_memd_factory):
    memd = await local_memd_factory(*FLAGS)
    seen: list[list[int]] = []
    memd.parts.runner.after_step.append(lambda outcome: seen.append([r.seq_id for r in outcome.results]))
    client = await memd.attach(block_size=16)
    copier, ways = memd.parts.runner.copier, []
    decides, queued = copier.inline, copier.apply

    def deciding(effects):                   # the runner settles a Step inline where this says yes
        ways.append("inline" if decides(effects) else "copier")
        return ways[-1] == "inline"

    async def counted_queued(effects):
        ways.append("queued")
        return await queued(effects)
    copier.inline, copier.apply = deciding, counted_queued

    opened, = await client.step(Open(list(range(40)), session_id="chat"))
    assert seen == [[opened.seq_id]]
    await client.step(Extend(opened.seq_id, commit_to=40), Park(opened.seq_id))
    assert seen[1] == [opened.seq_id, opened.seq_id] and ways == ["inline", "inline"]

    async with memd.admin() as admin:
        await admin.evict(session_id="chat", mode="swap")
    back, = await client.step(Resume(session_id="chat"))
    assert back.num_committed == 40 and ways[2] == "copier" and "queued" in ways   # a swap-in
    assert seen[-1] == [back.seq_id] and len(seen) == 3
    await client.close()
