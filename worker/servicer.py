"""ModelWorkerService: proto in, domain call, proto out. Errors are raised as MemsvcError and
mapped to status codes by memsvc.runtime.rpc_errors; nothing here decides policy."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import numpy as np
from google.protobuf import duration_pb2, timestamp_pb2

from memsvc.errors import InvalidArgument
from memsvc.runtime.deadline import caller_deadline
from memsvc.runtime.limits import MAX_ID_BYTES, check_length
from memsvc.runtime.rpc_errors import Context
from memsvc.runtime.swap_forms import swap_block_count
from memsvc.v1 import common_pb2 as common_pb
from memsvc.v1 import model_worker_service_pb2 as worker_pb
from memsvc.v1 import model_worker_service_pb2_grpc as worker_grpc
from memsvc.vocabulary import CopyMethod, SleepLevel, actions_from_proto
from worker.core import GenerateSlot, WorkerCore
from worker.generate_messages import StreamedText, check_request, generation_request, response
from worker.status import Status, Transition
from worker.telemetry import CLOSED, Event, EventKind, StateChange

if TYPE_CHECKING:
    from worker.model.generation import GenerationRequest
    from worker.model.kv_cache import KvStats


def swap_ids(request: worker_pb.SwapBlocksRequest) -> tuple[np.ndarray, np.ndarray]:
    """The request's (src ids, dst ids), from whichever form it uses, its shape checked first
    (memsvc/runtime/swap_forms.py). The raw u32le bytes are read in place and the packed lists convert in C
    (protobuf's repeated scalars implement ``__array__``); pairs cost a Python object per block."""
    raw_src, raw_dst = request.src_blocks_u32le, request.dst_blocks_u32le
    n = swap_block_count(
        len(request.pairs), len(request.src_blocks), len(request.dst_blocks), len(raw_src), len(raw_dst)
    )
    if raw_src:
        return np.frombuffer(raw_src, "<u4").astype(np.int64), np.frombuffer(raw_dst, "<u4").astype(np.int64)
    if len(request.src_blocks):
        return np.array(request.src_blocks, np.int64), np.array(request.dst_blocks, np.int64)
    pairs = request.pairs
    return (
        np.fromiter((p.src_block for p in pairs), np.int64, n),
        np.fromiter((p.dst_block for p in pairs), np.int64, n),
    )


def timestamp(t: float) -> timestamp_pb2.Timestamp:
    ts = timestamp_pb2.Timestamp()
    ts.FromNanoseconds(int(t * 1e9))
    return ts


def duration(seconds: float) -> duration_pb2.Duration:
    d = duration_pb2.Duration()
    d.FromNanoseconds(int(seconds * 1e9))
    return d


def transition_pb(t: Transition | None) -> common_pb.TransitionStats:
    if t is None:
        return common_pb.TransitionStats()
    return common_pb.TransitionStats(
        kind=t.kind,
        moved_bytes=t.moved_bytes,
        duration=duration(t.seconds),
        gigabytes_per_second=t.gigabytes_per_second,
        verified_bytes=t.verified_bytes,
        end_time=timestamp(t.end_time),
    )


def status_pb(s: Status) -> common_pb.WorkerStatus:
    mem = s.memory
    tags = []
    device = common_pb.DeviceInfo()
    if s.device is not None:
        d = s.device
        device = common_pb.DeviceInfo(backend=d.backend, index=d.index, name=d.name, uuid=d.uuid)
    host_pinned = disk = 0
    if mem is not None:
        device.total_bytes, device.free_bytes = mem.device_total_bytes, mem.device_free_bytes
        host_pinned, disk = mem.host_held_bytes, mem.disk_held_bytes
        for t in sorted(mem.tags.values(), key=lambda t: t.tag):
            tags.append(
                common_pb.TagMemory(
                    tag=t.tag,
                    state=t.state.proto,
                    mapped_bytes=t.mapped_bytes,
                    allocated_bytes=t.allocated_bytes,
                    offloaded_bytes=t.offloaded_bytes,
                    disk_bytes=t.disk_bytes,
                    discarded_bytes=t.discarded_bytes,
                    allocation_count=t.allocations,
                    awake_bytes=t.layout_bytes,
                )
            )
    m = s.model
    return common_pb.WorkerStatus(
        worker_id=s.worker_id,
        state=s.state.proto,
        device=device,
        model=common_pb.ModelInfo(
            source=m.source,
            family=m.family,
            parameter_count=m.parameter_count,
            weights_bytes=m.weights_bytes,
            vocab_size=m.vocab_size,
            layer_count=m.layer_count,
            context_length=m.context_length,
            eos_token_ids=m.eos_token_ids,
            has_tokenizer=m.has_tokenizer,
            has_chat_template=m.has_chat_template,
            served_model_name=m.served_model_name,
        ),
        tags=tags,
        kv_cache=kv_pb(s.kv_cache, s.recomputed_tokens),
        last_transition=transition_pb(s.last_transition),
        host_pinned_bytes=host_pinned,
        update_time=timestamp(s.time),
        last_activity_time=timestamp(s.last_activity),
        sleep_level=SleepLevel.proto_of(s.sleep_level),
        transition_in_progress=s.transition_in_progress,
        offload_dir=s.offload_dir,
        disk_bytes=disk,
        paused_generations=s.paused_generations,
    )


def kv_pb(kv: KvStats | None, recomputed_tokens: int = 0) -> common_pb.KvCacheInfo:
    """KvCacheInfo from :meth:`KvCache.stats` and the engine's count of tokens read again (empty
    before the model is loaded)."""
    if kv is None:
        return common_pb.KvCacheInfo()
    return common_pb.KvCacheInfo(
        block_bytes=kv["block_bytes"],
        block_size_tokens=kv["block_size"],
        device_block_count=kv["device_blocks"],
        device_free_block_count=kv["device_free_blocks"],
        host_block_count=kv["host_blocks"],
        host_free_block_count=kv["host_free_blocks"],
        sequence_count=kv["sequences"],
        recomputed_tokens=recomputed_tokens,
    )


def event_pb(e: Event) -> dict[str, Any]:
    """The ``event`` oneof of a telemetry message for a state change or a finished transition."""
    if isinstance(e.data, StateChange):
        change = e.data
        return {
            "state_change": common_pb.StateChange(
                from_state=change.old.proto, to_state=change.new.proto, reason=change.reason
            )
        }
    if isinstance(e.data, Transition):
        return {"transition": transition_pb(e.data)}
    raise ValueError(f"a {e.kind} event has nothing to send")


def _release_when_encoded(slot: GenerateSlot, encoding: asyncio.Future[GenerationRequest]) -> None:
    """The encoding of a caller who left has ended: its place in the bound is free (its result or
    error goes nowhere)."""
    slot.release()
    if not encoding.cancelled():
        encoding.exception()  # retrieved, so asyncio does not log it as never retrieved


class ModelWorkerServicer(worker_grpc.ModelWorkerServiceServicer):
    def __init__(self, core: WorkerCore) -> None:
        self.core = core

    async def GetWorkerStatus(
        self, request: worker_pb.GetWorkerStatusRequest, context: Any
    ) -> worker_pb.GetWorkerStatusResponse:
        return worker_pb.GetWorkerStatusResponse(status=status_pb(self.core.status()))

    async def Sleep(self, request: worker_pb.SleepRequest, context: Any) -> worker_pb.SleepResponse:
        level = SleepLevel.parse(request.level)
        actions = actions_from_proto(request.tag_actions)
        t, st = await self.core.sleep(
            level, actions, request.request_id, caller_deadline(context), request.pause_generations
        )
        return worker_pb.SleepResponse(status=status_pb(st), transition=transition_pb(t))

    async def WakeUp(self, request: worker_pb.WakeUpRequest, context: Any) -> worker_pb.WakeUpResponse:
        t, st = await self.core.wake(list(request.tags), request.request_id, caller_deadline(context))
        return worker_pb.WakeUpResponse(status=status_pb(st), transition=transition_pb(t))

    async def ReloadWeights(
        self, request: worker_pb.ReloadWeightsRequest, context: Any
    ) -> worker_pb.ReloadWeightsResponse:
        t, st = await self.core.reload_weights(request.request_id, request.model_path, caller_deadline(context))
        return worker_pb.ReloadWeightsResponse(status=status_pb(st), transition=transition_pb(t))

    async def SwapBlocks(self, request: worker_pb.SwapBlocksRequest, context: Any) -> worker_pb.SwapBlocksResponse:
        direction = {common_pb.SWAP_DIRECTION_DEVICE_TO_HOST: "out", common_pb.SWAP_DIRECTION_HOST_TO_DEVICE: "in"}.get(
            request.direction
        )
        if direction is None:
            raise InvalidArgument("direction must be SWAP_DIRECTION_DEVICE_TO_HOST or SWAP_DIRECTION_HOST_TO_DEVICE")
        method = CopyMethod.from_proto(request.method)
        src, dst = swap_ids(request)
        t = await self.core.swap_blocks(direction, src, dst, method)
        return worker_pb.SwapBlocksResponse(
            moved_bytes=t.moved_bytes,
            duration=duration(t.seconds),
            gigabytes_per_second=t.gigabytes_per_second,
            kv_cache=kv_pb(self.core.kv_stats(), self.core.recomputed_tokens),
        )

    async def prepare(self, request: worker_pb.GenerateRequest) -> tuple[GenerationRequest, GenerateSlot]:
        """The request checked (INVALID_ARGUMENT whatever the state), a place in the Generate bound,
        then the prompt encoded on a thread (a 1 MiB prompt or a long chat must not stall status and
        telemetry on the loop). The place is held until the encoding ends, even for a caller who left."""
        sampling = check_request(request)
        slot = self.core.reserve_generate()
        if request.stop:
            try:
                await self.core.stop_strings_ready()
            except BaseException:
                slot.release()
                raise
        encoding = asyncio.ensure_future(asyncio.to_thread(generation_request, request, sampling, self.core.text))
        try:
            return await asyncio.shield(encoding), slot
        except asyncio.CancelledError:
            encoding.add_done_callback(functools.partial(_release_when_encoded, slot))
            raise
        except BaseException:
            slot.release()
            raise

    async def prepare_stream(
        self, request: worker_pb.GenerateRequest, device_text: bool = True
    ) -> tuple[GenerationRequest, GenerateSlot, StreamedText]:
        """:meth:`prepare`, and the stream's text (what each token lets it send; nothing where the
        RPC front makes it: ``device_text`` false); the slot is the caller's once this returns."""
        spec, slot = await self.prepare(request)
        try:
            text = self.core.text_or_none() if device_text else None
            return spec, slot, StreamedText(text, spec.stop_set(self.core.eos_token_ids()), spec.stop_strings)
        except BaseException:
            slot.release()
            raise

    async def Generate(self, request: worker_pb.GenerateRequest, context: Any) -> worker_pb.GenerateResponse:
        return await self.generate(request)

    async def generate(
        self, request: worker_pb.GenerateRequest, device_text: bool = True
    ) -> worker_pb.GenerateResponse:
        """Generate; its answer without text where the RPC front makes it (``device_text`` false:
        worker/token_mux.py's GENERATE)."""
        spec, slot = await self.prepare(request)
        g = await self.core.generate(spec, slot=slot)
        return response(g, request.sequence_id, self.core.text_or_none() if device_text else None)

    async def GenerateStream(
        self, request: worker_pb.GenerateStreamRequest, context: Context
    ) -> AsyncIterator[worker_pb.GenerateStreamResponse]:
        """Generate, a message per token as it is made (several, when they come faster than they go)."""
        spec, slot, streamed = await self.prepare_stream(request.request)
        text = self.core.text_or_none()
        tokens: asyncio.Queue[int | None] = asyncio.Queue()
        post = self.core.post

        def made(token: int) -> None:  # on the device loop: a step's tokens reach the loop together
            post(tokens.put_nowait, token)

        # From here the task owns the slot: its first step (which hands the slot to the device job)
        # runs before this generator's first await returns, so it never is cancelled unstarted.
        task = asyncio.ensure_future(self.core.generate(spec, made, slot))
        # the end comes through the same queue, after every token (the engine posts a token before
        # its request's future is resolved, and that reaches the loop after the post)
        task.add_done_callback(lambda _: post(tokens.put_nowait, None))
        prompt_tokens = len(spec.prompt)  # told with the first message, then 0 (unset)
        try:
            while (first := await tokens.get()) is not None:
                batch = [first]
                end = False
                while not tokens.empty():
                    token = tokens.get_nowait()
                    if token is None:
                        end = True
                        break
                    batch.append(token)
                yield worker_pb.GenerateStreamResponse(
                    token_ids=batch, text="".join(streamed.push(t) for t in batch), prompt_token_count=prompt_tokens
                )
                prompt_tokens = 0
                if end:
                    break
            done = response(task.result(), request.request.sequence_id, text)
            yield worker_pb.GenerateStreamResponse(text=streamed.finish(done.text), done=done)
        finally:
            if not task.done():  # the client left: the generation stops at its next step
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    async def FreeSequence(
        self, request: worker_pb.FreeSequenceRequest, context: Any
    ) -> worker_pb.FreeSequenceResponse:
        await self.core.free_sequence(check_length(request.sequence_id, MAX_ID_BYTES, "sequence_id"))
        return worker_pb.FreeSequenceResponse(kv_cache=kv_pb(self.core.kv_stats(), self.core.recomputed_tokens))

    async def StreamTelemetry(
        self, request: worker_pb.StreamTelemetryRequest, context: Context
    ) -> AsyncIterator[worker_pb.StreamTelemetryResponse]:
        interval = request.interval.ToNanoseconds() / 1e9 if request.HasField("interval") else 1.0
        if interval < 0:
            raise InvalidArgument("interval must not be negative")
        interval = min(max(interval or 1.0, 0.05), 3600.0)
        queue = self.core.telemetry.subscribe()
        seq = 0
        try:
            seq += 1
            yield worker_pb.StreamTelemetryResponse(
                time=timestamp(self.core.status().time), sequence_number=seq, snapshot=status_pb(self.core.status())
            )
            while True:
                try:
                    event = await asyncio.wait_for(queue.get(), timeout=interval)
                except TimeoutError:
                    seq += 1
                    snap = self.core.status()
                    yield worker_pb.StreamTelemetryResponse(
                        time=timestamp(snap.time), sequence_number=seq, snapshot=status_pb(snap)
                    )
                    continue
                if event is CLOSED:
                    return
                if event.kind in (EventKind.ACTIVITY, EventKind.TRANSITION):
                    # traffic: a fresh snapshot carries last_activity_time; a transition: its memory
                    # figures, before the event itself (a state change alone carries none of them)
                    seq += 1
                    snap = self.core.status()
                    yield worker_pb.StreamTelemetryResponse(
                        time=timestamp(snap.time), sequence_number=seq, snapshot=status_pb(snap)
                    )
                    if event.kind == EventKind.ACTIVITY:
                        continue
                seq += 1
                yield worker_pb.StreamTelemetryResponse(
                    time=timestamp(event.time), sequence_number=seq, **event_pb(event)
                )
        finally:
            self.core.telemetry.unsubscribe(queue)
