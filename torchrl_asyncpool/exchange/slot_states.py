"""The slot state machine: one ``int32`` word per slot in the arena.

``FREE -> OBS_READY -> LEASED -> ACTION_READY -> (worker steps) -> OBS_READY``

Exactly one side may write each transition, which is what makes the plain stores safe
without locks:

* the worker owning a slot writes ``OBS_READY`` (after its record data) and ``ERROR``;
* the consumer writes ``LEASED`` (when ``recv`` hands the record out) and
  ``ACTION_READY`` (after the action data, in ``send``).

Data is always written before the state word, and the doorbell is rung after the state
word; the doorbell's system call is a full memory barrier on every architecture, and on
x86 (TSO) plain stores are already seen in program order.
"""
FREE = 0
OBS_READY = 1
LEASED = 2
ACTION_READY = 3
ERROR = 4

NAMES = {FREE: "FREE", OBS_READY: "OBS_READY", LEASED: "LEASED", ACTION_READY: "ACTION_READY", ERROR: "ERROR"}
