"""The loop as a list of per-step hooks: order, stopping, metrics one step late, eval decided once."""

import types

from jaxdist.training import hooks


class Recorder(hooks.Hook):
    def __init__(self, name, events):
        self.name, self.events = name, events

    def before_step(self, index, state):
        self.events.append((self.name, "before", index))

    def after_step(self, end):
        self.events.append((self.name, "after", end.done, end.last))


class Loader:
    """Batches and a position, as hooks.Batches reads them."""

    def __init__(self, items):
        self.items, self.i = list(items), 0

    def __next__(self):
        self.i += 1
        return self.items[self.i - 1]

    def get_state(self):
        return {"next_index": self.i}


def test_hooks_run_in_list_order_around_each_step():
    events = []
    state, done = hooks.run_steps(
        lambda s: (s + 1, {}), 0, 2, 5, lambda: False, [Recorder("a", events), Recorder("b", events)]
    )
    assert (state, done) == (3, 5)
    assert events == [
        ("a", "before", 2),
        ("b", "before", 2),
        ("a", "after", 3, False),
        ("b", "after", 3, False),
        ("a", "before", 3),
        ("b", "before", 3),
        ("a", "after", 4, False),
        ("b", "after", 4, False),
        ("a", "before", 4),
        ("b", "before", 4),
        ("a", "after", 5, True),
        ("b", "after", 5, True),
    ]


def test_a_stop_makes_this_step_the_last():
    events, asks = [], iter([False, True, False])
    state, done = hooks.run_steps(lambda s: (s + 1, {}), 0, 0, 10, lambda: next(asks), [Recorder("a", events)])
    assert (state, done) == (2, 2) and events[-1] == ("a", "after", 2, True)


def test_metrics_are_read_one_step_late_and_eval_steps_at_once():
    recorded = []
    progress = types.SimpleNamespace(
        record=lambda i, m, final=False, evaluate=None: recorded.append((i, final, evaluate() if evaluate else None))
    )
    evaluations = []
    metrics = hooks.Metrics(progress, lambda state: evaluations.append(state.params) or len(evaluations), eval_every=3)
    batches = hooks.Batches(Loader(range(100, 110)), first=99)
    seen = []

    def step_fn(s):
        seen.append(batches.current)
        return types.SimpleNamespace(params=f"p{s.params}", n=s.n + 1), {"n": s.n}

    start = types.SimpleNamespace(params="0", n=0)
    hooks.run_steps(step_fn, start, 0, 5, lambda: False, [batches, metrics])
    assert seen == [99, 100, 101, 102, 103]  # each step gets the batch drawn after the previous one
    # step 0 read when step 1 runs; step 2 (done=3, eval due) at once with its own state; the last at once
    assert [(i, final) for i, final, _ in recorded] == [(0, False), (1, False), (2, False), (3, False), (4, True)]
    assert [e for _, _, e in recorded] == [None, None, 1, None, 2]  # eval at done=3 and at the end (done=5)
    assert evaluations == ["ppp0", "ppppp0"]  # the params each eval step produced


def test_a_checkpoint_step_is_read_before_it_is_saved():
    """Checkpoint(before_save=Metrics.flush): step 2 (a save step) is read, with step 1 pending, before the
    save is written, so its log line comes first and the checkpoint carries the smoothed loss up to it;
    the metrics hook later in the list does not read it twice."""
    events = []
    progress = types.SimpleNamespace(record=lambda i, m, final=False, evaluate=None: events.append(("read", i)))
    saver = types.SimpleNamespace(
        due=lambda done, final=False: done % 2 == 0 or final,
        save=lambda state, done, loader: events.append(("save", done - 1)),
        poll=lambda: None,
    )
    metrics = hooks.Metrics(progress, None, eval_every=0)
    per_step = [hooks.Checkpoint(saver, None, before_save=metrics.flush), metrics]
    step = lambda s: (types.SimpleNamespace(params=s.params + 1), {})
    hooks.run_steps(step, types.SimpleNamespace(params=0), 0, 5, lambda: False, per_step)
    assert events == [
        ("read", 0),
        ("read", 1),
        ("save", 1),
        ("read", 2),
        ("read", 3),
        ("save", 3),
        ("read", 4),
        ("save", 4),
    ], events
