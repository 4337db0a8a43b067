"""data.sources / data.stages: proportions, stage changes, determinism over meshes and process splits,
exact resume, the run-out rule, config errors. The loader alone: no model is compiled."""

import json
import math
import re

import grain
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist import config
from jaxdist.checkpoint.compat import OMITTED_AT_DEFAULT
from jaxdist.data import loader as loader_mod
from jaxdist.data import mixture, run_tokenizer
from jaxdist.distributed import mesh as mesh_mod
from jaxdist.errors import JaxdistError
from jaxdist.observe import report
from jaxdist.training import rundir

SIZES = {"web": 3000, "code": 6000, "math": 2000}  # tokens; source i's ids are 100*i + (position % 50)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("mix")
    for i, (name, n) in enumerate(SIZES.items()):
        (np.arange(n) % 50 + 100 * i).astype(np.uint16).tofile(root / f"{name}.bin")
    return root


def sources(root, weights=(0.5, 0.3, 0.2)):
    return "[" + ", ".join(f"{{name: {n}, path: {root}/{n}.bin, weight: {w}}}" for n, w in zip(SIZES, weights)) + "]"


def mix_cfg(root, *extra, weights=(0.5, 0.3, 0.2)):
    base = ["model.vocab_size=300", "model.seq_len=16", "data.source=tokens", "train.steps=20", "train.eval_batches=2"]
    return config.load(None, [*base, f"data.sources={sources(root, weights)}", *extra])


def batch_sharding(shape: str) -> NamedSharding:
    return NamedSharding(mesh_mod.mesh_from_string(shape), P(("dp", "fsdp")))


def take(loader, n) -> list[np.ndarray]:
    return [np.asarray(next(loader)) for _ in range(n)]


def source_of(batch: np.ndarray) -> np.ndarray:
    return batch[:, 0] // 100  # every window of source i holds ids 100*i .. 100*i+49


def test_counts_are_grains_interleaving():
    """`counts` (what each source gave before a row, used at stage boundaries and in the saved state) is
    grain's own rule: checked against grain's mix element by element."""
    for props in ([1, 1], [100, 150, 400], [100, 333, 7000]):
        parents = [grain.MapDataset.range(1 << 40).map(lambda i, j=j: j) for j in range(len(props))]
        mixed = grain.MapDataset.mix(parents, props)
        seen = np.zeros(len(props), int)
        for n in range(600):
            assert list(seen) == mixture.counts(n, props), (props, n)
            seen[mixed[n]] += 1


def test_proportions_within_the_binomial_bound_and_a_stage_change_shows_at_its_step():
    """Over N rows each source's count is within 4 binomial standard deviations of N*weight (two-sided;
    grain's interleaving in fact keeps it within 1 row), and from the stage's step on the new weights hold."""
    sched = [(0, [0.5, 0.3, 0.2]), (50, [0.0, 0.25, 0.75])]
    stream = mixture.Stream(sched, 8, 3)
    before = np.concatenate([stream.sources_of_step(s) for s in range(50)])
    after = np.concatenate([stream.sources_of_step(s) for s in range(50, 100)])
    for rows, weights in ((before, sched[0][1]), (after, sched[1][1])):
        n = len(rows)
        for j, w in enumerate(weights):
            got, bound = np.count_nonzero(rows == j), 4 * math.sqrt(n * w * (1 - w))
            assert abs(got - n * w) <= max(bound, 1), (j, got, n * w, bound)
            assert abs(got - n * w) <= 1  # the interleaving's own guarantee
    assert 0 in stream.sources_of_step(49) and 0 not in stream.sources_of_step(50)
    # the next stage continues each source where the last left it: no window read twice within its epoch
    assert stream.read(50) == [200, 120, 80] and stream.read(100) == [200, 220, 380]


def test_same_global_batches_on_dp8_fsdp8_and_two_process_splits(corpus):
    cfg = mix_cfg(corpus, "data.stages=[{step: 10, weights: {web: 0, code: 1, math: 3}}]")
    dp = take(loader_mod.Loader(cfg, batch_sharding("dp=8")), 20)
    fsdp = take(loader_mod.Loader(cfg, batch_sharding("fsdp=8")), 20)
    for a, b in zip(dp, fsdp):
        np.testing.assert_array_equal(a, b)
    mix = loader_mod.Loader(cfg, batch_sharding("dp=8")).mixture
    halves = [loader_mod.mixed_batches(mix, 8, rows) for rows in ((0, 4), (4, 8))]  # 2 processes x 4 devices
    for s in range(20):
        np.testing.assert_array_equal(dp[s], np.concatenate([h[s] for h in halves]))
    assert {0, 1, 2} <= set(source_of(dp[9])) and 0 not in source_of(dp[10])  # the stage shows at step 10
    other = take(loader_mod.Loader(cfg.replace(train=dict(seed=1)), batch_sharding("dp=8")), 1)[0]
    assert not np.array_equal(other, dp[0])  # train.seed decides each source's order


def test_resume_at_step_7_gives_batches_8_to_20_unchanged_across_a_stage_boundary(corpus):
    cfg = mix_cfg(corpus, "data.stages=[{step: 10, weights: {web: 0, code: 1, math: 3}}]")
    whole = take(loader_mod.Loader(cfg, batch_sharding("dp=8")), 20)
    first = loader_mod.Loader(cfg, batch_sharding("dp=8"))
    take(first, 7)
    state = first.get_state()
    assert state["next_index"] == 7 and state["sources"] == {"web": 28, "code": 17, "math": 11}
    again = loader_mod.Loader(cfg, batch_sharding("fsdp=8"))
    again.set_state(state)
    for a, b in zip(whole[7:], take(again, 13)):
        np.testing.assert_array_equal(a, b)


def test_a_resume_with_other_weights_continues_each_source_where_it_was(corpus):
    cfg = mix_cfg(corpus)
    first = loader_mod.Loader(cfg, batch_sharding("dp=8"))
    take(first, 7)
    state = first.get_state()
    changed = loader_mod.Loader(mix_cfg(corpus, weights=(0.1, 0.1, 0.8)), batch_sharding("dp=8"))
    changed.set_state(state)
    stream = changed.mixture.stream
    read = {j: [stream[g][1] for g in range(7 * 8, 12 * 8) if stream[g][0] == j] for j in range(3)}
    for j, name in enumerate(SIZES):  # each source's next window is the one after those it gave
        assert read[j][0] == state["sources"][name] and read[j] == list(range(read[j][0], read[j][0] + len(read[j])))


def test_a_source_that_runs_out_repeats_reshuffled_or_stops_the_run(corpus):
    cfg = mix_cfg(corpus, "train.steps=100")
    loader = loader_mod.Loader(cfg, batch_sharding("dp=8"))
    line = report.data_line(cfg, loader)
    assert "a mixture of 3 sources" in line and "math: 1 token file" in line and "weight 0.2" in line
    assert "1.31 epochs" in line  # math: 160 windows read of its 122 (2000 tokens: 124 windows, 2 held out)
    mix = loader.mixture
    n = len(mix.train[2])
    rows = [g for g in range(100 * 8) if mix.stream[g][0] == 2]
    first, second = [mix.window(g) for g in rows[:n]], [mix.window(g) for g in rows[n : 2 * n]]
    assert sorted(map(tuple, first)) == sorted(tuple(mix.train[2][i]) for i in range(n))  # each window once
    assert [tuple(w) for w in first[: len(second)]] != [tuple(w) for w in second]  # then reshuffled
    with pytest.raises(
        JaxdistError,
        match=r"data.sources web: 100 steps read 400 windows of its 184, so it runs "
        r"out after 46 steps and data.on_exhausted=stop",
    ):
        loader_mod.Loader(cfg.replace(data=dict(on_exhausted="stop")), batch_sharding("dp=8"))


def test_eval_is_per_source(corpus):
    loader = loader_mod.Loader(mix_cfg(corpus), batch_sharding("dp=8"))
    assert loader.eval_names == ["web", "web", "code", "code", "math", "math"]
    assert [set(source_of(np.asarray(b))) for b in loader.eval_arrays()] == [{0}] * 2 + [{1}] * 2 + [{2}] * 2
    got = mixture.eval_losses(["a", "a", "b"], [(2.0, 1.0), (4.0, 3.0), (9.0, 3.0)])
    assert got == {"loss": 15.0 / 7.0, "loss/a": 1.5, "loss/b": 3.0}


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["data.sources=[{name: a, path: x, weight: 0}]"],
            r"data.sources\[0\] \(a\) has weight 0.0; weights must be > 0",
        ),
        (["data.sources=[{name: a, path: x, weight: -1}]"], r"has weight -1.0; weights must be > 0"),
        (["data.sources=[{name: a, path: x}, {name: a, path: y}]"], "repeats the name 'a'"),
        (["data.sources=[{name: a, path: x}]", "data.path=y"], "data.path='y' and data.sources are both set"),
        (
            ["data.sources=[{name: a, path: x}]", "data.stages=[{step: 5, weights: {a: 0}}]"],
            "gives every source weight 0",
        ),
        (["data.sources=[{name: a, path: x}]", "data.stages=[{step: 5, weights: {b: 1}}]"], "names source 'b'"),
        (["data.sources=[{name: a, path: x}]", "data.stages=[{step: 0, weights: {a: 1}}]"], r"step=0 must be > 0"),
        (["data.stages=[{step: 5, weights: {a: 1}}]"], "data.sources, which is empty"),
        (
            ["data.sources=[{name: a, path: x}]", "data.stages=[{step: 20, weights: {a: 2}}]", "train.steps=20"],
            r"data.stages\[0\].step=20 is past the run's last step \(train.steps=20\), so its weights would never apply",
        ),
        (
            [
                "data.sources=[{name: a, path: x}]",
                "data.stages=[{step: 5, weights: {a: 1}}, {step: 5, weights: {a: 2}}]",
            ],
            r"data.stages\[1\].step=5 must be > 5",
        ),
        (["data.sources=[{name: a, path: x, wieght: 1}]"], r"unknown config key 'data.sources\[0\].wieght'"),
        (["data.sources=[{name: a, path: x, weight: lots}]"], r"data.sources\[0\].weight must be float"),
        (["data.sources=a"], "data.sources must be a list of mappings"),
    ],
)
def test_bad_mixture_config_is_one_line(overrides, message):
    with pytest.raises(JaxdistError, match=message):
        config.load(None, overrides)


def test_a_missing_source_sources_tokenized_differently_and_pairs_are_refused(corpus):
    cfg = config.load(None, ["data.source=tokens", "data.sources=[{name: gone, path: /nonexistent/x.bin}]"])
    with pytest.raises(JaxdistError, match=r"^data.sources gone: data.path='/nonexistent/x.bin' matches no files"):
        loader_mod.Loader(cfg, batch_sharding("dp=8"))
    from test_tokenize import word_tokenizer

    from jaxdist.data import prepare

    (corpus / "doc.txt").write_text("a b a b " * 100)
    tok = word_tokenizer(corpus / "tok", post_bos=False)
    assert (
        prepare.main(
            [
                "prepare",
                "--tokenizer",
                str(tok),
                "--out",
                str(corpus / "prep"),
                "--workers",
                "1",
                str(corpus / "doc.txt"),
            ]
        )
        == 0
    )
    two = f"data.sources=[{{name: words, path: {corpus}/prep}}, {{name: ids, path: {corpus}/web.bin}}]"
    with pytest.raises(
        JaxdistError, match=r"were tokenized differently \(words: tokenizer [0-9a-f]{12}, ids: unknown\)"
    ):
        run_tokenizer.of_config(config.load(None, ["data.source=tokens", two]))
    with pytest.raises(JaxdistError, match="which data.sources does not mix"):
        loader_mod.Loader(mix_cfg(corpus, "objective.method=dpo"), batch_sharding("dp=8"))


def test_mixture_keys_at_their_defaults_leave_run_names_unchanged(corpus):
    assert {k: OMITTED_AT_DEFAULT[k] for k in ("data.sources", "data.stages", "data.on_exhausted")} == {
        "data.sources": [],
        "data.stages": [],
        "data.on_exhausted": "repeat",
    }
    assert rundir.identity(config.Config()) == "bef0e0b4"
    cfg = mix_cfg(corpus)
    assert rundir.identity(cfg) != rundir.identity(mix_cfg(corpus, weights=(0.2, 0.3, 0.5)))
    assert config.from_dict(config.yaml_load(config.dump(cfg))) == cfg  # config.yaml reads back the same


def test_a_mixture_trains_evaluates_per_source_and_resumes_each_source(corpus, tmp_path):
    """End to end (MICRO_MODEL): the data line per source, eval_loss/NAME beside eval_loss, and a resume
    whose stage weights changed (--allow-config-change data) continues each source from its checkpoint."""
    from conftest import MICRO_MODEL, NO_PLOT

    from jaxdist import run

    model = [f"model.{k}={v}" for k, v in MICRO_MODEL.items() if k != "seq_len"] + [NO_PLOT]
    cfg = mix_cfg(corpus, *model).replace(train=dict(steps=2, eval_every=2, eval_batches=1), checkpoint=dict(every=2))
    said = []
    run(cfg, tmp_path / "run", log=said.append)
    assert any(str(m).startswith("data: a mixture of 3 sources") for m in said)
    assert any(re.search(r"eval.* loss .*, web \d\.\d{4}, code \d\.\d{4}, math \d\.\d{4}", str(m)) for m in said), said
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "eval_loss" in r and "step" in r]
    assert [r["step"] for r in evals] == [2]
    for r in evals:
        per = [r[f"eval_loss/{n}"] for n in SIZES]
        assert all(np.isfinite(per)) and min(per) <= r["eval_loss"] <= max(per)  # a token-weighted mean of them
    later = cfg.replace(train=dict(steps=3, eval_every=0), data=dict(stages=[{"step": 2, "weights": {"math": 1.0}}]))
    seen = {}
    original = loader_mod.Loader.set_state

    def spy(self, state):
        seen.update(state)
        original(self, state)
        seen["next"] = [self.mixture.stream[g] for g in range(2 * 8, 3 * 8)]

    try:
        loader_mod.Loader.set_state = spy
        run(later, tmp_path / "run", log=lambda *a: None, allowed=frozenset({"data.stages"}))
    finally:
        loader_mod.Loader.set_state = original
    assert seen["sources"] == {"web": 8, "code": 5, "math": 3}  # 2 steps of 8 rows at 0.5 / 0.3 / 0.2
    assert seen["next"] == [(2, 3 + i) for i in range(8)]  # math only, from its 4th window on


def test_a_resume_on_changed_source_files_is_refused_unless_accepted(corpus, tmp_path):
    from jaxdist.data import corpus as corpus_mod

    cfg = mix_cfg(corpus)
    meta = {"corpus": corpus_mod.fingerprint(cfg)}
    assert meta["corpus"]["files"] == 3 and meta["corpus"]["bytes"] == 2 * sum(SIZES.values())
    corpus_mod.check_unchanged(meta, cfg, tmp_path, frozenset())  # the same files: fine
    (tmp_path / "more.bin").write_bytes(b"\0\0" * 100)
    more = cfg.replace(
        data=dict(sources=[*cfg.to_dict()["data"]["sources"], {"name": "more", "path": str(tmp_path / "more.bin")}])
    )
    with pytest.raises(JaxdistError, match="on a corpus that changed since it was saved \\(3 files"):
        corpus_mod.check_unchanged(meta, more, tmp_path, frozenset())
    corpus_mod.check_unchanged(meta, more, tmp_path, frozenset({"data.sources"}))
