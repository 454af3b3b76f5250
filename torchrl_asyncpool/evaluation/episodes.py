"""What an evaluation runs and what it reports: episodes, results, and their JSON files.

A manifest is a JSON list of episodes (or an object with an ``"episodes"`` list); each entry
has an ``"episode_id"`` and optionally a ``"seed"``, a ``"max_steps"`` and reset ``"options"``
(an object, for gymnasium envs). Results come back
in manifest order, one per episode, each with exactly one of three statuses:

``"completed"``  the env ended the episode (terminated, or truncated by the env itself)
``"timeout"``    the evaluation cut it: ``max_steps`` steps, or ``episode_timeout_s`` seconds
``"failed"``     the env raised while building, resetting or stepping for this episode
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from typing import List, Optional, Sequence

from torchrl_asyncpool.errors import SetupRefused

__all__ = ["Episode", "EpisodeResult", "STATUSES", "load_manifest", "summarize", "write_results"]

#: the three statuses an :class:`EpisodeResult` can have
STATUSES = ("completed", "timeout", "failed")


@dataclass(frozen=True)
class Episode:
    """One episode of an evaluation set.

    Args:
        episode_id (str): a name, unique within the set.
        seed (int, optional): the seed the env is reset with (``None``: unseeded).
        max_steps (int, optional): steps after which the evaluation cuts the episode
            (status ``"timeout"``, unless the env ends it itself at that very step: then it is
            ``"completed"``); ``None`` uses :func:`~torchrl_asyncpool.evaluation.evaluate`'s
            ``max_steps``.
        options (dict, optional): passed to a gymnasium env's ``reset(options=...)`` (a TorchRL
            env given options fails the episode: it has no such argument).

    Examples:
        >>> from torchrl_asyncpool.evaluation import Episode
        >>> Episode("cartpole-0", seed=0, max_steps=500)
        Episode(episode_id='cartpole-0', seed=0, max_steps=500, options=None)
    """

    episode_id: str
    seed: Optional[int] = None
    max_steps: Optional[int] = None
    options: Optional[dict] = None

    def __post_init__(self):
        if not isinstance(self.episode_id, str) or not self.episode_id:
            raise ValueError(f"episode_id must be a non-empty string, got {self.episode_id!r}.")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0):
            raise ValueError(f"episode {self.episode_id!r}: seed must be None or an int >= 0, got {self.seed!r}.")
        if self.max_steps is not None and (
            isinstance(self.max_steps, bool) or not isinstance(self.max_steps, int) or self.max_steps < 1
        ):
            raise ValueError(
                f"episode {self.episode_id!r}: max_steps must be None or an int >= 1, got {self.max_steps!r}."
            )
        if self.options is not None and not isinstance(self.options, dict):
            raise ValueError(f"episode {self.episode_id!r}: options must be None or a dict, got {self.options!r}.")

    def __hash__(self):  # options is a dict: hash by id, the rest of the identity is the id anyway
        return hash(self.episode_id)


@dataclass
class EpisodeResult:
    """The outcome of one :class:`Episode`.

    Attributes:
        episode_id (str): the episode's name.
        status (str): ``"completed"``, ``"timeout"`` or ``"failed"`` (see the module doc).
        episode_return (float): the sum of the rewards received (up to the cut, for a timeout).
        length (int): steps taken.
        terminated (bool): the env ended the episode in a terminal state.
        truncated (bool): the env cut the episode itself (its own time limit).
        seed (int or None): the seed the env was reset with.
        env_index (int or None): the slot that ran it.
        error (str or None): why a ``"failed"`` or wall-clock ``"timeout"`` episode ended.

    Examples:
        >>> from torchrl_asyncpool.evaluation import EpisodeResult
        >>> r = EpisodeResult("a", "completed", episode_return=21.0, length=812, terminated=True, seed=0)
        >>> r.status, r.episode_return, r.error
        ('completed', 21.0, None)
    """

    episode_id: str
    status: str
    episode_return: float = 0.0
    length: int = 0
    terminated: bool = False
    truncated: bool = False
    seed: Optional[int] = None
    env_index: Optional[int] = None
    error: Optional[str] = None


def load_manifest(path) -> List[Episode]:
    """Reads a manifest (see the module doc) into episodes; ``ValueError`` names what is wrong.

    Args:
        path (str or os.PathLike): a JSON file holding a list of episode objects (or
            ``{"episodes": [...]}``), each with an ``"episode_id"`` and optionally ``"seed"``,
            ``"max_steps"`` and ``"options"``.

    Returns:
        list of :class:`Episode`, in the file's order.

    Raises:
        ValueError: the file is not JSON, holds no episodes, or an entry lacks its id, has an
            unknown field or repeats an id (the message names the entry).

    Examples:
        >>> import json, os, tempfile
        >>> from torchrl_asyncpool.evaluation import load_manifest
        >>> path = os.path.join(tempfile.mkdtemp(), "manifest.json")
        >>> with open(path, "w") as f:
        ...     json.dump([{"episode_id": "a", "seed": 0}, {"episode_id": "b", "seed": 1, "max_steps": 100}], f)
        >>> [(e.episode_id, e.seed, e.max_steps) for e in load_manifest(path)]
        [('a', 0, None), ('b', 1, 100)]
    """
    with open(path) as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"manifest {path}: not valid JSON ({exc}).") from None
    if isinstance(data, dict):
        data = data.get("episodes")
    if not isinstance(data, list) or not data:
        raise ValueError(f"manifest {path}: expected a non-empty list of episodes (or {{'episodes': [...]}}).")
    episodes = []
    for i, entry in enumerate(data):
        if not isinstance(entry, dict) or "episode_id" not in entry:
            raise ValueError(f"manifest {path}: entry {i} must be an object with an 'episode_id', got {entry!r}.")
        unknown = set(entry) - {"episode_id", "seed", "max_steps", "options"}
        if unknown:
            raise ValueError(f"manifest {path}: entry {i} has unknown fields {sorted(unknown)}.")
        episodes.append(Episode(entry["episode_id"], entry.get("seed"), entry.get("max_steps"), entry.get("options")))
    check_unique(episodes)
    return episodes


def check_unique(episodes: Sequence[Episode]) -> None:
    seen = set()
    for ep in episodes:
        if ep.episode_id in seen:
            raise ValueError(f"episode ids must be unique; {ep.episode_id!r} appears twice.")
        seen.add(ep.episode_id)


def check_episode_set(episodes, num_envs: int, what: str) -> List[Episode]:
    """The episodes as a list, after checking that they are Episodes with unique ids (at least
    one) and that ``num_envs`` is an int >= 1; ``what`` ends the empty-set message."""
    episodes = list(episodes)
    if not episodes:
        raise ValueError(f"episodes is empty: nothing to {what}.")
    for i, ep in enumerate(episodes):
        if not isinstance(ep, Episode):
            raise TypeError(f"episodes[{i}] must be an Episode, got {type(ep).__name__}.")
    check_unique(episodes)
    if isinstance(num_envs, bool) or not isinstance(num_envs, int) or num_envs < 1:
        raise ValueError(f"num_envs must be an int >= 1, got {num_envs!r}.")
    return episodes


def write_results(results: Sequence[EpisodeResult], path) -> None:
    """Writes results (manifest order) and a summary as JSON: ``{"summary": ..., "episodes": [...]}``.

    The file is valid JSON: a return that is not finite (NaN or infinite rewards) is written
    as ``null``. It is written atomically: into a temporary file next to ``path``, then renamed
    over it, so that ``path`` holds either its previous content or every result, never a part.

    Args:
        results (sequence of EpisodeResult): what :func:`~torchrl_asyncpool.evaluation.evaluate`
            returned.
        path (str or os.PathLike): the results file.

    Raises:
        OSError: ``path`` cannot be written (e.g. its folder does not exist); nothing is left
            behind.

    Examples:
        >>> import json, os, tempfile
        >>> from torchrl_asyncpool.evaluation import EpisodeResult, write_results
        >>> path = os.path.join(tempfile.mkdtemp(), "results.json")
        >>> write_results([EpisodeResult("a", "completed", episode_return=float("nan"), length=3)], path)
        >>> data = json.load(open(path))
        >>> data["summary"]["completed"], data["episodes"][0]["episode_return"]
        (1, None)
    """
    data = _finite({"summary": summarize(results), "episodes": [asdict(r) for r in results]})
    text = json.dumps(data, indent=1, allow_nan=False)
    path = os.fspath(path)
    tmp = os.path.join(os.path.dirname(path) or ".", f".{os.path.basename(path)}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w") as f:  # plain open: the file gets the usual permissions (umask)
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def check_output_path(path) -> None:
    """Checks, before an evaluation runs, that :func:`write_results` will be able to write
    ``path``: its folder exists and takes a new file, and ``path`` is not a folder.

    Parameters
    ----------
    path : str or os.PathLike
        The results file.

    Raises
    ------
    OSError
        Names the path and what is wrong with it.
    """
    path = os.fspath(path)
    folder = os.path.dirname(path) or "."
    if os.path.isdir(path):
        raise IsADirectoryError(f"output {path!r} is a folder; expected the path of a results file.")
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"output {path!r}: its folder {folder!r} does not exist.")
    probe = os.path.join(folder, f".{os.path.basename(path)}.{os.getpid()}.probe")
    try:
        with open(probe, "w"):
            pass
    except OSError as exc:
        raise type(exc)(exc.errno, f"output {path!r}: cannot create a file in {folder!r} ({exc.strerror})") from None
    os.unlink(probe)


def _finite(value):
    """``value`` with every float that is not finite replaced by ``None`` (JSON has no NaN)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def summarize(results: Sequence[EpisodeResult]) -> dict:
    """Counts per status and the mean return and length of the completed episodes.

    Args:
        results (sequence of EpisodeResult): what :func:`~torchrl_asyncpool.evaluation.evaluate`
            returned.

    Returns:
        dict: ``"episodes"`` (how many), one count per status (``"completed"``, ``"timeout"``,
        ``"failed"``), and ``"mean_return"`` / ``"mean_length"`` over the completed episodes
        (``None`` when none completed).

    Examples:
        >>> from torchrl_asyncpool.evaluation import EpisodeResult, summarize
        >>> summarize([EpisodeResult("a", "completed", 10.0, 5), EpisodeResult("b", "completed", 20.0, 7),
        ...            EpisodeResult("c", "timeout", 3.0, 100)])
        {'episodes': 3, 'completed': 2, 'timeout': 1, 'failed': 0, 'mean_return': 15.0, 'mean_length': 6.0}
    """
    done = [r for r in results if r.status == "completed"]
    return {
        "episodes": len(results),
        **{status: sum(r.status == status for r in results) for status in STATUSES},
        "mean_return": math.fsum(r.episode_return for r in done) / len(done) if done else None,
        "mean_length": sum(r.length for r in done) / len(done) if done else None,
    }


#: bytes of one slot in a :class:`PlanProgress` file: three little-endian 8-byte counts
_SLOT_BYTES = 24


class PlanProgress:
    """How far each slot of one pool got through its planned episodes, kept in a small file so
    that every process of the pool sees it: the workers write it, a rebuilt env reads it.

    Slot ``s`` has three numbers: how many of its planned episodes have begun their reset (an
    entry is taken when the env adapter reads its seed), where the plan of the slot's latest
    env starts, and which of its planned episodes the env last ended itself (truncated) at the
    very step of its step limit (the driver then reports it completed, not cut: both end as a
    truncation, the record alone cannot tell them apart). An env rebuilt after a failure
    (``evaluate(..., on_env_failure="restart")``), in its worker or in a worker that replaces a
    dead one, gets the plan from there on: the rest of its slot's episodes, with their own
    seeds. The driver reads the first two to tell which episode a
    ``FIRST`` record starts (the worker waits for its answer, so they are settled): the last one
    taken, or none when the slot's env was built after its plan had run out.

    Picklable: a slot's :meth:`slot` view travels in its :class:`PlannedEnvFactory`; the file is
    opened lazily in each process that uses it.
    """

    def __init__(self, path: str, num_slots: int):
        self.path, self.num_slots = path, num_slots
        self._fd = None
        self._pid = None

    @classmethod
    def create(cls, num_slots: int) -> "PlanProgress":
        """A new file of ``num_slots`` zeros (in the temporary folder); :meth:`remove` deletes it."""
        import tempfile

        fd, path = tempfile.mkstemp(prefix="torchrl_asyncpool_eval_", suffix=".progress")
        try:
            os.write(fd, bytes(_SLOT_BYTES * num_slots))
        finally:
            os.close(fd)
        return cls(path, num_slots)

    def __getstate__(self):
        return {"path": self.path, "num_slots": self.num_slots}

    def __setstate__(self, state):
        self.__init__(state["path"], state["num_slots"])

    def _file(self) -> int:
        if self._fd is None or self._pid != os.getpid():
            self._fd, self._pid = os.open(self.path, os.O_RDWR), os.getpid()
        return self._fd

    def taken(self, slot: int) -> int:
        """Planned episodes of ``slot`` whose reset has begun."""
        return int.from_bytes(os.pread(self._file(), 8, _SLOT_BYTES * slot), "little")

    def take(self, slot: int, position: int) -> None:
        """The reset of ``slot``'s planned episode ``position`` (0-based) begins."""
        os.pwrite(self._file(), (position + 1).to_bytes(8, "little"), _SLOT_BYTES * slot)

    def built_from(self, slot: int) -> int:
        """The position in its plan where the plan of ``slot``'s latest env starts."""
        return int.from_bytes(os.pread(self._file(), 8, _SLOT_BYTES * slot + 8), "little")

    def build(self, slot: int, start: int) -> None:
        """``slot``'s env was built with the plan from position ``start`` on."""
        os.pwrite(self._file(), start.to_bytes(8, "little"), _SLOT_BYTES * slot + 8)

    def ended_by_env(self, slot: int, position: int) -> bool:
        """Whether the env of ``slot`` ended its planned episode ``position`` itself, truncated
        at the step of its step limit (see :meth:`note_ended_by_env`)."""
        return int.from_bytes(os.pread(self._file(), 8, _SLOT_BYTES * slot + 16), "little") == position + 1

    def note_ended_by_env(self, slot: int, position: int) -> None:
        """The env of ``slot`` truncated its planned episode ``position`` itself at the step its
        step limit cut it (written in the worker before the episode's last record is published)."""
        os.pwrite(self._file(), (position + 1).to_bytes(8, "little"), _SLOT_BYTES * slot + 16)

    def slot(self, s: int) -> "_SlotProgress":
        return _SlotProgress(self, s)

    def remove(self) -> None:
        """Deletes the file (the pool is closed: no worker writes it any more)."""
        if self._fd is not None and self._pid == os.getpid():
            os.close(self._fd)
        self._fd = None
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


class _SlotProgress:
    """One slot's view of a :class:`PlanProgress`."""

    def __init__(self, progress: PlanProgress, slot: int):
        self.progress, self.index = progress, slot

    def taken(self) -> int:
        return self.progress.taken(self.index)

    def take(self, position: int) -> None:
        self.progress.take(self.index, position)

    def build(self, start: int) -> None:
        self.progress.build(self.index, start)

    def note_ended_by_env(self, position: int) -> None:
        self.progress.note_ended_by_env(self.index, position)


class _PlanEntry:
    """One ``(seed, max_steps, options)`` entry of an env's episode plan that notes, when the
    env adapter unpacks it at a reset (``seed, limit, options = entry``: the only way the
    adapter reads an entry), that the slot's episode ``position`` has begun."""

    __slots__ = ("entry", "position", "progress")

    def __init__(self, entry, position: int, progress: _SlotProgress):
        self.entry, self.position, self.progress = tuple(entry), position, progress

    def __iter__(self):
        self.progress.take(self.position)
        return iter(self.entry)

    def ended_by_env(self) -> None:
        """The env truncated this episode itself at the step of its step limit (called by the
        env adapter's :class:`~torchrl_asyncpool.envs.env_attrs.EpisodePlan`)."""
        self.progress.note_ended_by_env(self.position)

    def __getitem__(self, k):
        return self.entry[k]

    def __len__(self):
        return len(self.entry)

    def __repr__(self):
        return f"_PlanEntry({self.entry!r}, position={self.position})"


class PlannedEnvFactory:
    """Builds the user's env and attaches the seeds, step limits and reset options of the
    episodes one slot will run, in order (read by the worker's env adapter at each reset).
    Picklable when the wrapped factory is.

    Only envs built in another process (the workers) get the plan: the pool also builds one
    env in the calling process to learn the specs and may step it to measure its cost, and
    those resets must not run the episodes' seeds or options.

    With a ``progress`` (one slot's view of a :class:`PlanProgress`), every reset notes which
    planned episode it starts, and an env built again for the slot (a rebuild after a failure)
    gets only the episodes that had not begun: the slot goes on with its next episode, with that
    episode's seed, however many envs it took.
    """

    def __init__(self, create_env_fn, plan, progress: Optional[_SlotProgress] = None):
        self.create_env_fn = create_env_fn
        self.plan = [tuple(p) for p in plan]
        self.progress = progress
        self._owner_pid = os.getpid()

    def __call__(self, **kwargs):
        # imported here, not with this module: the episodes and their results need no torch
        from torchrl_asyncpool.envs.adapters import is_vector_env, remote_listener
        from torchrl_asyncpool.envs.env_attrs import EPISODE_PLAN_ATTR

        env = self.create_env_fn(**kwargs)
        if is_vector_env(env):  # raised in the calling process, by the pool's spec env
            try:
                env.close()
            except Exception:  # noqa: BLE001 - e.g. a SerialEnv never started refuses to close
                pass
            raise SetupRefused(
                f"evaluate() runs one episode per env at a time and needs single envs; create_env_fn returned a "
                f"{type(env).__name__} (a vector or batched env). Pass a factory of one env (e.g. gymnasium.make)."
            )
        if remote_listener(env) is not None:
            env.close()
            raise SetupRefused(
                "evaluate() seeds and limits every episode in the workers; a remote env slot's host owns its env and "
                "its resets, so fixed episode sets need local envs."
            )
        if os.getpid() != self._owner_pid:
            setattr(env, EPISODE_PLAN_ATTR, self._remaining_plan())
        return env

    def _remaining_plan(self) -> list:
        if self.progress is None:
            return self.plan
        start = self.progress.taken()
        self.progress.build(start)
        return [_PlanEntry(entry, k, self.progress) for k, entry in enumerate(self.plan) if k >= start]
