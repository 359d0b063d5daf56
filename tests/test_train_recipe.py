"""The training recipe resolved from the data (eyas_train.recipe): sensible at both ends of the data sizes,
overridable knob by knob, and a validation slice chosen by sample id."""

from __future__ import annotations

import pytest

from eyas_train.config import TrainConfig
from eyas_train.recipe import peak_lr, predicted_acceptance, replay_acceptance, resolve, split_by_sample, val_count


def cfg(**kw) -> TrainConfig:
    return TrainConfig(hidden="hidden/h", model="/m", name="d", **kw)


def test_small_data_gets_enough_steps_at_a_high_rate():
    # 100 samples of about 100 tokens on a 128-wide draft (the fixture's size)
    n_val = val_count(100, None, world=1)
    r = resolve(cfg(), lengths=[100] * (100 - n_val), n_val=n_val, width=128, world=1)
    assert n_val == 12 and r.train_samples == 88
    # as small as a batch gets: 256 tokens a step (the lr anchor); smaller steps lost acceptance (README)
    assert r.batch_size == 3 and r.epochs == 20
    assert r.total_steps == 20 * (88 // 3)       # all 20 epochs; 10 epochs of batch 16 gave 50 steps
    assert r.lr == pytest.approx(3e-3)           # the fixture's tuned rate, not the 1e-4 of 600k-sample runs
    assert 0 < r.warmup_steps <= 0.05 * r.total_steps
    assert r.eval_every == r.total_steps // 20


def test_large_data_matches_the_peers_scale():
    # 1M samples of 8k tokens on a Kimi-K2-wide draft (7168)
    n = 1_000_000
    n_val = val_count(n, None, world=8)
    r = resolve(cfg(), lengths=[8192] * (n - n_val), n_val=n_val, width=7168, world=8)
    assert n_val == 1000
    assert r.batch_size == 8 and r.batch_size * r.tokens_per_sample == 65536  # 16k tokens rounded up to 8 ranks
    assert r.epochs == 1 and r.total_steps == (n - n_val) // 8                 # one pass: past the token budget
    assert 3e-5 <= r.lr <= 1e-4                                                # the peers' 1e-4 order
    assert r.warmup_steps == 500


def test_middle_sizes_trade_batch_for_steps():
    for n, batch, lr in ((1000, 10, 3e-3), (4000, 40, 3e-3)):
        r = resolve(cfg(), lengths=[100] * n, n_val=50, width=128, world=1)
        assert (r.batch_size, r.total_steps, r.epochs) == (batch, 2000, 20)
        assert r.lr == pytest.approx(lr)
    # 250 samples of ~71 tokens (bench/quality.py): 4 samples a step, not the 2 the step floor alone asks
    assert resolve(cfg(), lengths=[71] * 218, n_val=31, width=128, world=1).batch_size == 4
    # below 256 tokens a step (a --batch-size set small) the rate follows Adam's square-root rule
    assert peak_lr(128, 128) == pytest.approx(3e-3 / 2**0.5)
    assert peak_lr(16384, 4096) == pytest.approx(9.375e-5)


def test_every_knob_overrides_the_rule():
    r = resolve(cfg(batch_size=4, lr=1e-2, epochs=3, warmup_steps=7, eval_every=11), lengths=[50] * 400,
                n_val=20, width=128, world=1)
    assert (r.batch_size, r.lr, r.total_steps, r.warmup_steps, r.eval_every) == (4, 1e-2, 300, 7, 11)
    r = resolve(cfg(min_steps=100, max_epochs=5, batch_tokens=1000), lengths=[100] * 400, n_val=0, width=128,
                world=1)
    assert r.batch_size == 10 and r.epochs == 5 and r.total_steps == 200 and r.eval_every == 0
    assert resolve(cfg(epochs=0), lengths=[10] * 40, n_val=0, width=128, world=1).total_steps == 0
    with pytest.raises(ValueError, match="fewer than one batch of 64"):
        resolve(cfg(batch_size=64), lengths=[10] * 40, n_val=0, width=128, world=1)


def test_validation_slice_is_chosen_by_sample_id():
    ids = list(range(1000, 1200))
    train, val = split_by_sample(ids, 20, seed=0)
    assert len(val) == 20 and not set(train) & set(val) and sorted(train + val) == list(range(200))
    # the same samples whatever the order they are stored in (shard layout), another slice with another seed
    shuffled = ids[::-1]
    _, val_rev = split_by_sample(shuffled, 20, seed=0)
    assert {shuffled[i] for i in val_rev} == {ids[i] for i in val}
    assert set(split_by_sample(ids, 20, seed=1)[1]) != set(val)
    assert val_count(200, 7, world=2) == 6  # a multiple of the process count
    assert val_count(24, None, world=1) == 3 and val_count(24, 0, world=1) == 0
    with pytest.raises(ValueError, match="--val-samples 30 leaves no training sample of 30"):
        val_count(30, 30, world=1)


def test_predicted_acceptance_is_the_chain_product():
    acc = [0.9, 0.8, 0.5, 0.1]
    assert predicted_acceptance(acc, 1) == pytest.approx(1.9)
    assert predicted_acceptance(acc, 3) == pytest.approx(1 + 0.9 + 0.72 + 0.36)
    assert predicted_acceptance([1.0] * 7, 3) == 4.0


def test_replay_decodes_each_completion_span_as_a_greedy_verifier_would():
    mask = [0, 0] + [1] * 8  # prompt rows 0-1; completion x_2..x_9; the first root is row 1
    assert replay_acceptance([3] * 10, mask, 3) == (2, 6)  # roots 1 and 5, 3 accepted each: length 4.0
    assert replay_acceptance([0] * 10, mask, 3) == (7, 0)  # a root at every row 1..7: length 1.0
    # two spans (an earlier turn): each decoded from the row before it; lead capped at spec_tokens
    assert replay_acceptance([5] * 12, [0, 1, 1, 1, 0, 0, 1, 1, 1, 1, 1, 1], 2) == (1 + 2, 2 + 4)


def test_replay_drafts_more_often_from_hard_rows_than_the_chain_product_counts():
    # easy rows (lead 3) and hard rows (lead 0) alternate in blocks: every row is as likely easy as hard,
    # yet a decoder leaves an easy row 4 tokens on and a hard row 1 token on, so it drafts mostly from hard
    # rows. The per-row average lead is 1.5 (1 + a0 + a0 a1 + a0 a1 a2 = 2.5); the decoder's is lower.
    lead = ([3] * 4 + [0] * 4) * 8
    mask = [0] + [1] * (len(lead) - 1)
    drafts, accepted = replay_acceptance(lead, mask, 3)
    assert 1 + accepted / drafts == pytest.approx(1 + 3 / 5, abs=0.05)
    assert 1 + accepted / drafts < predicted_acceptance([0.5, 1.0, 1.0], 3)


def test_a_first_window_of_lengths_resolves_as_the_whole_data_would():
    # --order shards: the lengths of the first window stand for all n samples (their mean, not their sum / n;
    # the bench's streamed draft trained at lr 4.7e-4 instead of 3e-3 before this was right)
    whole = resolve(cfg(), lengths=[100] * 388, n_val=12, width=128, world=1)
    window = resolve(cfg(), lengths=[100] * 8, n_val=12, width=128, world=1, n=388)
    assert window == whole
