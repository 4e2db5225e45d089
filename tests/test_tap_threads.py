"""Op taps under threads: the count of running layertap hooks is per thread.

``nn.DataParallel`` runs each replica's hooks in a thread of its own. A count of running hooks
shared by every thread would hide one thread's ops while another thread is inside a hook, and a
lost update of it (``x += 1`` is not atomic) would hide every later op tap in the process.
"""

import sys
import threading
import time

import torch
from torch import nn

import layertap

CALLS = 150  # forwards per thread


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x)) + x  # the op ":add" of the model


def _run_threads(targets: list) -> None:
    errors: list[BaseException] = []

    def guarded(target):
        def run():
            try:
                target()
            except BaseException as e:  # re-raised in the main thread
                errors.append(e)

        return run

    threads = [threading.Thread(target=guarded(t)) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def test_op_taps_see_every_op_while_other_threads_run_hooks_and_after():
    torch.manual_seed(0)
    tapped = Block()
    others = [nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)) for _ in range(3)]
    xs = [torch.randn(4, 8) for _ in range(CALLS)]
    seen: list[torch.Tensor] = []

    def op_thread():
        keep = lambda name, kind, call, value: seen.append(value.clone())
        with torch.no_grad(), layertap.tap(tapped, ":add", observe=keep):
            for x in xs:
                tapped(x)
                time.sleep(0)  # let the other threads run between forwards too

    def hook_thread(model: nn.Module):
        def slow(name, kind, call, value):
            time.sleep(0)  # inside a layertap hook: give the other threads the interpreter

        def run():
            with torch.no_grad(), layertap.tap(model, ["0", "1", "2"], capture=("input", "output"), observe=slow):
                for _ in range(CALLS):
                    model(torch.randn(4, 8))

        return run

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can: races show
    try:
        _run_threads([op_thread] + [hook_thread(m) for m in others])
    finally:
        sys.setswitchinterval(interval)

    with torch.no_grad():
        reference = [torch.relu(tapped.fc(x)) + x for x in xs]  # the same computation, batch by batch
    assert len(seen) == CALLS, f"the op tap saw {len(seen)} of {CALLS} calls of ':add'"
    assert all(torch.equal(got, want) for got, want in zip(seen, reference))

    # a later op tap, in this thread, still captures: against a clone at the model's own hook
    # (the model returns what its ':add' returns)
    cloned = {}
    handle = tapped.register_forward_hook(lambda m, a, out: cloned.update(out=out.clone()))
    try:
        with torch.no_grad(), layertap.tap(tapped, [":add", ":relu"]) as t:
            tapped(xs[0])
    finally:
        handle.remove()
    assert torch.equal(t[":add"], cloned["out"])
    with torch.no_grad():
        assert torch.equal(t[":relu"], torch.relu(tapped.fc(xs[0])))


def test_one_op_tap_on_one_model_run_by_several_threads_at_once_sees_every_forward():
    # a server's request threads, or DataParallel-style replicas sharing modules: each thread's
    # forward has its own frames, so no thread's op is lost or counted in another's forward
    torch.manual_seed(0)
    model = Block()
    xs = [torch.randn(4, 8) for _ in range(8)]
    rounds = 20
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        with torch.no_grad(), layertap.tap(model, [":add", ":relu", "fc"], keep="all") as t:
            _run_threads([lambda x=x: [model(x) for _ in range(rounds)] for x in xs])
    finally:
        sys.setswitchinterval(interval)
    with torch.no_grad():  # the same computation, input by input
        want = {"fc": [model.fc(x) for x in xs]}
        want[":relu"] = [torch.relu(h) for h in want["fc"]]
        want[":add"] = [r + x for r, x in zip(want[":relu"], xs)]
    for name, values in want.items():
        got = t.outputs[name]
        assert len(got) == rounds * len(xs), f"{name}: {len(got)} of {rounds * len(xs)} calls"
        # calls interleave across threads: each value is one input's, each input's value comes `rounds` times
        matches = [[i for i, v in enumerate(values) if torch.equal(g, v)] for g in got]
        assert all(len(m) == 1 for m in matches)
        assert sorted(m[0] for m in matches) == sorted(list(range(len(xs))) * rounds)
