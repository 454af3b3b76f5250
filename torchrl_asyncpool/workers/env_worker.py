"""The env worker process: hosts one or more env slots and owns their autoreset.

Loop (per wake-up of the worker's doorbell)::

    drain doorbell -> for each hosted slot in ACTION_READY:
        if the last record was terminal: discard the action, publish the (already reset) FIRST
        else: step, publish MID / TERMINATION / TRUNCATION
    -> reset the envs that just ended (eagerly, while the consumer computes the discarded action)
    -> block in poll(doorbell, parent life pipe)

Slots hosted by the same worker are stepped as their actions arrive, not in lockstep. Nothing
here allocates shared memory or pickles a tensor: records are copied into the arena, the state
word is set after the data, and the consumer's doorbell is rung after the state word.
"""
from __future__ import annotations

import os
import select
import time
import traceback

import torch

from torchrl_asyncpool.exchange import slot_states as S
from torchrl_asyncpool.exchange.arena import Arena
from torchrl_asyncpool.exchange.doorbell import Doorbell
from torchrl_asyncpool.step_type import StepType
from torchrl_asyncpool.workers.env_adapter import make_adapter

__all__ = ["worker_main"]

_FIRST, _MID, _TERM, _TRUNC = int(StepType.FIRST), int(StepType.MID), int(StepType.TERMINATION), int(StepType.TRUNCATION)


class _Slot:
    """Everything one hosted env needs on the hot path, resolved once."""

    __slots__ = ("index", "adapter", "obs_views", "reward_view", "action_views", "recurrent", "ended", "pending_first")

    def __init__(self, index, adapter, arena, recurrent):
        self.index = index
        self.adapter = adapter
        req = arena.request
        self.obs_views = [(k, req.get(k)[index]) for k in adapter.obs_keys]
        self.reward_view = req.get("reward")[index]
        self.action_views = {k: arena.response.get(k)[index] for k in adapter.action_keys}
        # (hidden_in view, hidden_out view): the last answered state is fed back as input
        self.recurrent = [(req.get(i)[index], arena.response.get(o)[index]) for i, o in recurrent.items()]
        self.ended = False
        self.pending_first = None


class _Worker:
    def __init__(self, worker_id, layout, arena_fd, bell_fd, consumer_fd, life_fd, conn):
        self.worker_id = worker_id
        self.layout = layout
        self._phase, self._current = "construction", None
        self.started = False
        self.conn = conn
        self.arena = Arena.attach(layout, arena_fd)
        self.bell = Doorbell(bell_fd)
        self.consumer = Doorbell(consumer_fd)
        self.life_fd = life_fd
        a = self.arena
        self.state, self.ready_time = a.state, a.ready_time
        self.step_time, self.step_count = a.step_time, a.step_count
        self.step_type = a.request.get("step_type").numpy()
        self.done = a.request.get("done").numpy()
        self.terminated = a.request.get("terminated").numpy()
        self.truncated = a.request.get("truncated").numpy()
        self.slots = []

    def build(self, slot_ids, env_fns, env_kwargs):
        layout, a = self.layout, self.arena
        recurrent = getattr(layout, "recurrent", {})
        expected_request = {f.key: (f.shape, f.dtype) for f in layout.request if f.key not in recurrent}
        actions = getattr(layout, "action_keys", None)
        expected_response = {f.key: (f.shape, f.dtype) for f in layout.response if actions is None or f.key in actions}
        for index, fn, kw in zip(slot_ids, env_fns, env_kwargs):
            self._phase, self._current = "construction", index
            adapter = make_adapter(fn(**kw), index)
            request, response = (_keyed(d) for d in adapter.fields())
            _check_fields(index, "observation/reward/done", expected_request, request)
            _check_fields(index, "action", expected_response, response)
            self.slots.append(_Slot(index, adapter, a, recurrent))

    # -- publishing ---------------------------------------------------------------------------
    def _publish(self, slot, td, reward, step_type):
        i = slot.index
        for key, view in slot.obs_views:
            view.copy_(td.get(key))
        if reward is None:
            slot.reward_view.zero_()
        else:
            slot.reward_view.copy_(reward)
        for hidden_in, hidden_out in slot.recurrent:
            if step_type == _FIRST:
                hidden_in.zero_()
            else:
                hidden_in.copy_(hidden_out)
        self.step_type[i] = step_type
        self.terminated[i] = step_type == _TERM
        self.truncated[i] = step_type == _TRUNC
        self.done[i] = step_type >= _TERM
        self.ready_time[i] = time.monotonic()
        self.state[i] = S.OBS_READY  # after the data: the consumer may read it from now on
        self.consumer.ring()

    def _timed_reset(self, slot):
        self._phase, self._current = "reset", slot.index
        t = time.perf_counter()
        td = slot.adapter.reset()
        self.step_time[slot.index] += time.perf_counter() - t
        self.step_count[slot.index] += 1
        return td

    def _serve(self, slot):
        if slot.ended:
            # NEXT_STEP autoreset: the action answering a terminal record is discarded.
            td = slot.pending_first if slot.pending_first is not None else self._timed_reset(slot)
            slot.pending_first = None
            slot.ended = False
            self._publish(slot, td, None, _FIRST)
            return False
        self._phase, self._current = "step", slot.index
        t = time.perf_counter()
        td, reward, terminated, truncated = slot.adapter.step(slot.action_views)
        self.step_time[slot.index] += time.perf_counter() - t
        self.step_count[slot.index] += 1
        st = _TERM if terminated else (_TRUNC if truncated else _MID)
        self._publish(slot, td, reward, st)
        slot.ended = st != _MID
        return slot.ended

    # -- main loop ----------------------------------------------------------------------------
    def run(self):
        for slot in self.slots:
            self._publish(slot, self._timed_reset(slot), None, _FIRST)
        self.conn.send(("ready", self.worker_id, None, None))
        self.started = True
        poller = select.poll()
        poller.register(self.bell.fd, select.POLLIN)
        poller.register(self.life_fd, select.POLLIN)
        state, slots = self.state, self.slots
        while True:
            for fd, _ in poller.poll():
                if fd == self.life_fd:
                    return
            self.bell.drain()  # before the scan: a ring after this point wakes the next poll
            ended = []
            for slot in slots:
                if state[slot.index] == S.ACTION_READY:
                    if self._serve(slot):
                        ended.append(slot)
            for slot in ended:
                # Eager reset hides reset latency behind the consumer's (discarded) answer.
                if slot.pending_first is None and state[slot.index] != S.ACTION_READY:
                    slot.pending_first = self._timed_reset(slot)


def _keyed(fields):
    return {((k,) if isinstance(k, str) else tuple(k)): v for k, v in fields.items()}


def _check_fields(index, what, expected, got):
    if expected.keys() != got.keys():
        raise ValueError(
            f"env {index}: {what} keys {sorted(map(str, got))} differ from the pool layout "
            f"{sorted(map(str, expected))} (all envs of a pool must share their specs)."
        )
    for k, spec in expected.items():
        if tuple(got[k][0]) != tuple(spec[0]) or got[k][1] != spec[1]:
            raise ValueError(
                f"env {index}: {what} entry {k!r} has shape {tuple(got[k][0])} and dtype {got[k][1]}; "
                f"the pool layout expects shape {tuple(spec[0])} and dtype {spec[1]}."
            )


def worker_main(worker_id, slot_ids, env_fns, env_kwargs, layout, arena_fd, bell_fd, consumer_fd, life_fd, conn, num_threads):
    """Entry point of a worker process (see the module docstring)."""
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    worker = None
    try:
        env_fns = [getattr(fn, "fn", fn) for fn in env_fns]
        worker = _Worker(worker_id, layout, arena_fd.fd, bell_fd.fd, consumer_fd.fd, life_fd.fd, conn)
        worker.build(slot_ids, env_fns, env_kwargs)
        worker.run()
    except BaseException:  # noqa: BLE001 - everything is reported to the consumer, then we exit
        tb = traceback.format_exc()
        phase = worker._phase if worker is not None else "start-up"
        index = worker._current if worker is not None and worker._current is not None else slot_ids[0]
        try:
            if worker is not None and worker.started:
                worker.arena.write_error(index, f"{phase}\n{tb}")
                worker.state[index] = S.ERROR  # after the text
            else:
                conn.send(("error", worker_id, index, (phase, tb)))
            Doorbell(consumer_fd.fd).ring()
        except BaseException:  # noqa: BLE001 - the parent may be gone already
            pass
    finally:
        if worker is not None:
            for slot in worker.slots:
                slot.adapter.close()
        os._exit(0)

