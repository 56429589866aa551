"""The worker's load in process (host backend): the state reads AWAKE only once the load's transition
lock is free, so a client that sees AWAKE (a status poll, the telemetry watch) and sends a Generate at
once is served. A fresh-clone run on a busy 2-core machine met the load still holding the lock: the
serving bench's first Generate got FAILED_PRECONDITION ("a transition is pending"). And where the
model's text is read: by the RPC front's process, or by the load."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from asyncwait import wait_until
from hf_models import text_model

from memsvc.errors import MemsvcError
from memsvc.vocabulary import FinishReason, WorkerState
from worker.config import WorkerConfig
from worker.core import WorkerCore
from worker.front_text import FrontText
from worker.model.generation import GenerationRequest
from worker.model.text_source import TextInfo, TextSource
from worker.telemetry import Event, StateChange

pytestmark = pytest.mark.asyncio


async def test_the_state_reads_awake_only_once_the_load_lets_go_of_the_transition_lock() -> None:
    core = WorkerCore(
        WorkerConfig(
            model="synthetic:tiny", backend="host", kv_blocks=32, host_kv_blocks=8, host_capacity_bytes=256 << 20
        ),
        asyncio.get_running_loop(),
    )
    publish = core.telemetry.publish
    held_at_awake: list[bool] = []

    def watching(event: Event) -> None:  # called where the state changes (the device loop), as it does
        if isinstance(event.data, StateChange) and event.data.new == WorkerState.AWAKE:
            held_at_awake.append(core._sm.in_progress)
            if not core._sm.in_progress:
                core.reserve_generate().release()  # what a client seeing AWAKE does first
        publish(event)

    core.telemetry.publish = watching  # type: ignore[method-assign]
    try:
        await core.load()
        assert held_at_awake == [False]
        generation = await core.generate(GenerationRequest([5, 6, 7], 3, ignore_eos=True))
        assert len(generation.tokens) == 3
    finally:
        await core.close()


async def _loaded(text_in_front: bool, model: str = "synthetic:tiny", front_dir: str = "") -> WorkerCore:
    core = WorkerCore(
        WorkerConfig(model=model, backend="host", kv_blocks=32, host_kv_blocks=8, host_capacity_bytes=256 << 20),
        asyncio.get_running_loop(),
        text_in_front=text_in_front,
    )
    if text_in_front:  # what worker/main.py relays between the RPC front's reading and the load

        async def front() -> None:
            where = await asyncio.wrap_future(core.text_source)
            text = FrontText(front_dir)
            found = await text.read(where)
            core.text_found.set_result(TextInfo(**found["info"]))
            core.decode_with(await text.write_decoding(where))

        relay = asyncio.ensure_future(front())
    await core.load()
    if text_in_front:
        await relay
    return core


async def test_with_the_text_in_the_front_the_device_process_reads_only_its_decoding_while_idle(
    tmp_path: Path,
) -> None:
    """The load tells where the text is and reports what the front found, without reading it. Once
    the engine idles, the device process reads the decoding alone the front wrote (for stop strings,
    matched on the engine's thread), never the whole text; a request with stop strings ends at one."""
    path, reference = text_model(tmp_path)
    core = await _loaded(True, str(path), str(tmp_path))
    try:
        source = core.runner.source if core.runner is not None else None
        assert source is not None
        assert core.text_source.result() == TextSource(directory=str(path))
        assert core.status().model is not None and core.status().model.has_chat_template
        assert not source.text_once._read, "the load read the text the front reads"
        await wait_until(lambda: source.text_once._decoding is not None, "the decoding's read while idle", timeout=60)
        assert (tmp_path / FrontText.DECODING_FILE).is_file()
        whole = await core.generate(GenerationRequest([5, 6, 7], 12, ignore_eos=True))
        text = reference.decode(whole.tokens, skip_special_tokens=True)
        stop = text[len(text) // 2 :][:3]
        assert stop, text
        cut = await core.generate(GenerationRequest([5, 6, 7], 12, ignore_eos=True, stop_strings=(stop,)))
        assert cut.matched_stop == stop and cut.finish_reason == FinishReason.STOP
        n = len(cut.tokens)  # it ends at the first token whose text holds the stop string, as transformers decodes it
        assert cut.tokens == whole.tokens[:n]
        assert stop in reference.decode(cut.tokens, skip_special_tokens=True)
        assert stop not in reference.decode(cut.tokens[:-1], skip_special_tokens=True)
        assert not source.text_once._read, "the whole text was read for stop strings"
    finally:
        await core.close()


@pytest.mark.parametrize("where", ["", "absent"])  # no directory given; one its writer cannot write in
async def test_a_front_that_wrote_no_decoding_leaves_the_device_process_to_read_the_whole_text(
    tmp_path: Path, where: str
) -> None:
    path, _ = text_model(tmp_path)
    core = await _loaded(True, str(path), str(tmp_path / where) if where else "")
    try:
        source = core.runner.source if core.runner is not None else None
        assert source is not None
        await asyncio.wait_for(core.stop_strings_ready(), 60)  # told that there is none: no wait
        await wait_until(lambda: source.text_once._read, "the whole text's read while idle", timeout=60)
        assert (await core.generate(GenerationRequest([5, 6, 7], 3, ignore_eos=True, stop_strings=("zz",)))).tokens
    finally:
        await core.close()


async def test_without_a_front_the_load_reads_the_text_and_a_failed_load_tells_none() -> None:
    core = await _loaded(False)
    try:
        assert core.runner is not None and core.runner.source.text_once._read
    finally:
        await core.close()
    missing = WorkerCore(  # it fails before it knows where the text is: the relay ends, nothing read
        WorkerConfig(model="synthetic:no-such-preset", backend="host", host_capacity_bytes=256 << 20),
        asyncio.get_running_loop(),
        text_in_front=True,
    )
    with pytest.raises(MemsvcError):
        await missing.load()
    assert missing.text_source.cancelled()
    await missing.close()


async def test_a_checkpoint_directory_is_told_to_the_front_as_the_load_begins(tmp_path: Path) -> None:
    """Before the load reads anything of the model (here a directory without its config.json, which
    the load then refuses): the front reads the text beside the whole load, at a lower priority
    (worker/background.py), instead of after torch's import."""
    core = WorkerCore(
        WorkerConfig(model=str(tmp_path), backend="host", host_capacity_bytes=256 << 20),
        asyncio.get_running_loop(),
        text_in_front=True,
    )
    with pytest.raises(MemsvcError, match="config.json"):
        await core.load()
    assert core.text_source.result() == TextSource(directory=str(tmp_path))
    await core.close()
