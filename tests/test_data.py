import numpy as np
import pytest

from jaxdist.data import corpus
from jaxdist.data import loader as loader_mod
from jaxdist.data.files import expand_path
from jaxdist.distributed import mesh as mesh_mod
from jaxdist.errors import JaxdistError
from jaxdist.training import rundir, step


@pytest.fixture(scope="module")
def token_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "train.bin"
    np.arange(5000, dtype=np.uint16).__mod__(300).astype(np.uint16).tofile(path)
    return path


def tokens_cfg(tiny_cfg, path, **model):
    return tiny_cfg.replace(data=dict(source="tokens", path=str(path)), model=dict(vocab_size=300, seq_len=16, **model))


def test_windows_are_contiguous_and_cover_the_stream(tiny_cfg, token_file):
    train, held_out = loader_mod.load_windows(tokens_cfg(tiny_cfg, token_file))
    w0, w1 = train[0], train[1]
    assert len(w0) == 17 and w0[-1] == w1[0]  # next window starts where the last target was
    assert len(train) + len(held_out) == (5000 - 1) // 16
    assert held_out[0][0] == train[len(train) - 1][-1]  # eval is the tail of the same stream


def test_global_batch_is_independent_of_process_split(tiny_cfg, token_file):
    train, _ = loader_mod.load_windows(tokens_cfg(tiny_cfg, token_file))
    whole = loader_mod.batches(train, 8, seed=1, rows=(0, 8))
    halves = [loader_mod.batches(train, 8, seed=1, rows=r) for r in [(0, 4), (4, 8)]]
    quarters = [loader_mod.batches(train, 8, seed=1, rows=(2 * i, 2 * i + 2)) for i in range(4)]
    for s in [0, 1, 57]:
        np.testing.assert_array_equal(whole[s], np.concatenate([h[s] for h in halves]))
        np.testing.assert_array_equal(whole[s], np.concatenate([q[s] for q in quarters]))
    assert not np.array_equal(whole[0], loader_mod.batches(train, 8, seed=2, rows=(0, 8))[0])


def test_epochs_reshuffle_and_cover_everything(tiny_cfg, token_file):
    train, _ = loader_mod.load_windows(tokens_cfg(tiny_cfg, token_file))
    n = len(train)
    ds = loader_mod.batches(train, 1, seed=0, rows=(0, 1))
    first = [tuple(ds[s][0]) for s in range(n)]
    second = [tuple(ds[s][0]) for s in range(n, 2 * n)]
    assert sorted(first) == sorted(second) == sorted(tuple(train[i]) for i in range(n))
    assert first != second


def test_default_corpus_is_the_standard_library(tiny_cfg):
    train, held_out = loader_mod.load_windows(tiny_cfg)
    assert len(train) > 10_000 and len(held_out) > 100
    files = loader_mod.stdlib_files()
    assert all("site-packages" not in f for f in files)
    stream = loader_mod.read_text(files[:3], separator=0)  # the stream starts with the first files, in order
    assert train[0].astype(np.uint8).tobytes() == stream[: tiny_cfg.model.seq_len + 1].tobytes()


def test_loader_places_global_batches_and_resumes(tiny_cfg):
    cfg = tiny_cfg.replace(model=dict(num_layers=2, d_model=64, mlp_dim=128, seq_len=16))
    prog = step.build_program(cfg, mesh_mod.mesh_from_string("dp=2,fsdp=4"))
    loader = loader_mod.Loader(cfg, prog.batch_sharding)
    first = next(loader)
    assert first.shape == (8, 17) and first.sharding == prog.batch_sharding
    state = loader.get_state()
    expected = np.asarray(next(loader))
    again = loader_mod.Loader(cfg, prog.batch_sharding)
    again.set_state(state)
    np.testing.assert_array_equal(np.asarray(next(again)), expected)
    assert [b.shape for b in loader.eval_arrays()] == [(8, 17)] * cfg.train.eval_batches


def test_bad_data_is_a_clear_error(tiny_cfg, token_file, tmp_path):
    with pytest.raises(JaxdistError, match="matches no files"):
        loader_mod.load_windows(tiny_cfg.replace(data=dict(path=str(tmp_path / "none*.txt"))))
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(JaxdistError, match="too few for one window"):
        loader_mod.load_windows(tiny_cfg.replace(data=dict(path=str(tmp_path / "empty.txt"))))
    with pytest.raises(JaxdistError, match="model.vocab_size"):
        loader_mod.load_windows(tiny_cfg.replace(data=dict(source="tokens", path=str(token_file))))
    with pytest.raises(JaxdistError, match="byte tokens"):
        loader_mod.load_windows(tiny_cfg.replace(model=dict(vocab_size=128)))


def test_a_run_folder_inside_the_data_folder_is_not_data(tiny_cfg, tmp_path):
    """A run folder (it holds the trainer's lock) under data.path is skipped: otherwise its growing files
    would join the corpus and every resume would refuse a 'changed corpus'."""
    (tmp_path / "a.txt").write_text("first document " * 40)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.txt").write_text("second document " * 40)
    cfg = tiny_cfg.replace(data=dict(path=str(tmp_path)))
    before = corpus.fingerprint(cfg)
    lock = rundir.RunLock(tmp_path / "runs" / "r1")
    lock.acquire()
    try:
        (tmp_path / "runs" / "r1" / "metrics.jsonl").write_text('{"step": 1}\n')
        (tmp_path / "runs" / "notes.txt").write_text("a file beside run folders is still data")
        files = [p[len(str(tmp_path)) + 1 :] for p in expand_path(str(tmp_path))]
        assert files == ["a.txt", "runs/notes.txt", "sub/b.txt"]
        (tmp_path / "runs" / "notes.txt").unlink()
        assert corpus.fingerprint(cfg) == before
    finally:
        lock.release()
