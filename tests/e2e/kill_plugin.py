"""Test-only plugin, loaded through a workflow's ``plugins:`` list: kills one training rank's
process (``os._exit(1)``) at the start of its N-th train step, as a crashed node would.

Enabled by ``POSTTRAIN_TEST_KILL_AT_STEP=N`` (forwarded to the ranks through
``cluster.runtime_env.env_vars``); ``POSTTRAIN_TEST_KILL_RANK`` picks the rank (default 1);
``POSTTRAIN_TEST_KILL_SIGNAL=SIGSEGV`` (or another signal's name) has the process die of that
signal instead, as one that crashes in native code does. ``POSTTRAIN_TEST_KILL_NODE=1`` kills
its whole node instead: SIGKILL to every process of the rank's session, as a machine that loses
power would (tests/e2e/test_multi_node.py starts each Ray node, its raylet and the workers it
forks, in a session of its own; a session with the test or the driver in it is never killed).
"""

import contextlib
import os
import signal

from posttrain import hookimpl

_calls = {"train_step": 0}


@hookimpl(wrapper=True)
def posttrain_train_step(worker, batch, loss_fn):
    _calls["train_step"] += 1
    step = os.environ.get("POSTTRAIN_TEST_KILL_AT_STEP")
    rank = int(os.environ.get("POSTTRAIN_TEST_KILL_RANK", "1"))
    if step and _calls["train_step"] == int(step) and worker.rank == rank:
        signal_name = os.environ.get("POSTTRAIN_TEST_KILL_SIGNAL")
        print(f"kill_plugin: exiting rank {worker.rank} at train step {step}", flush=True)
        if os.environ.get("POSTTRAIN_TEST_KILL_NODE") == "1":
            _kill_session()
        if signal_name:
            os.kill(os.getpid(), signal.Signals[signal_name])
        os._exit(1)
    return (yield)


def _kill_session() -> None:
    """SIGKILL every process of this one's session, this one last."""
    session = os.getsid(0)
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # it exited meanwhile
            continue
        if int(fields[3]) == session:  # the 6th field of stat: the session id
            if "pytest" in cmdline or "posttrain.cli" in cmdline or "bin/posttrain" in cmdline:
                raise RuntimeError(f"kill_plugin: not killing session {session}: it has {cmdline}")
            members.append(int(entry))
    print(f"kill_plugin: killing node (session {session}: {len(members)} processes)", flush=True)
    for pid in members:
        with contextlib.suppress(ProcessLookupError):  # it exited meanwhile
            os.kill(pid, signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)
