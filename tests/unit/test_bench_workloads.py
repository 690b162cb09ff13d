"""Workloads, prompt making and arrivals: determinism, exact lengths, distributions."""
from __future__ import annotations

import itertools
import json
import math
import statistics

import numpy as np
import pytest

from bench.arrivals import arrival_offsets, parse_rate, parse_rates
from bench.prompts import PromptMaker, load_tokenizer
from bench.workloads import LengthDist, WorkloadConfig, iter_specs

pytestmark = pytest.mark.unit


def take(cfg, n, seed=0, maker=None):
    return list(itertools.islice(iter_specs(cfg, maker or PromptMaker("ids"), seed), n))


def test_length_dist_parse_and_sample():
    rng = np.random.default_rng(0)
    assert LengthDist.parse("256") == LengthDist("fixed", 256)
    assert LengthDist.parse("fixed:7").sample(rng) == 7
    u = LengthDist.parse("uniform:10:12")
    assert {u.sample(rng) for _ in range(200)} == {10, 11, 12}
    ln = LengthDist.parse("lognormal:300:1.0")
    xs = [ln.sample(rng) for _ in range(4000)]
    assert 270 < statistics.median(xs) < 330 and max(xs) > 3000  # median 300, long tail
    nm = LengthDist.parse("normal:5:50")
    assert min(nm.sample(rng) for _ in range(500)) == 1            # clamped to >= 1
    assert str(LengthDist.parse("normal:5:2")) == "normal:5:2"
    for bad in ("zipf:1:2", "uniform:5", "uniform:9:3", "-4", "abc", "normal:0:1"):
        with pytest.raises(ValueError):
            LengthDist.parse(bad)


def test_random_is_deterministic_with_exact_id_lengths():
    cfg = WorkloadConfig(input_len=LengthDist.parse("uniform:5:50"),
                         output_len=LengthDist.parse("uniform:1:9"))
    a, b, c = take(cfg, 20, seed=3), take(cfg, 20, seed=3), take(cfg, 20, seed=4)
    assert a == b and a != c
    for spec in a:
        assert isinstance(spec.prompt, list) and len(spec.prompt) == spec.input_len
        assert all(1000 <= t < 8000 for t in spec.prompt) and 1 <= spec.output_len <= 9
    # changing the output distribution leaves the prompts untouched (separate streams)
    other = take(WorkloadConfig(input_len=cfg.input_len), 20, seed=3)
    assert [s.prompt for s in other] == [s.prompt for s in a]


def test_text_prompts_without_tokenizer_are_words():
    spec = take(WorkloadConfig(input_len=LengthDist("fixed", 12)), 1,
                maker=PromptMaker("text"))[0]
    assert isinstance(spec.prompt, str) and len(spec.prompt.split()) == 12
    assert not PromptMaker("text").exact and PromptMaker("ids").exact


def test_prefix_workload_shares_system_prompts():
    cfg = WorkloadConfig(name="prefix", num_prefixes=3, prefix_len=40,
                         input_len=LengthDist("fixed", 8))
    specs = take(cfg, 60)
    systems = {tuple(s.system) for s in specs}
    assert len(systems) == 3 and all(len(p) == 40 for p in systems)
    assert all(s.input_len == 48 and len(s.prompt) == 8 for s in specs)
    assert len({tuple(s.prompt) for s in specs}) == 60                # unique suffixes


def test_mixed_workload_fraction_and_categories():
    cfg = WorkloadConfig(name="mixed", long_fraction=0.25, input_len=LengthDist("fixed", 4),
                         long_input_len=LengthDist("fixed", 64),
                         long_output_len=LengthDist("fixed", 2))
    specs = take(cfg, 800)
    long = [s for s in specs if s.category == "long"]
    assert 0.2 < len(long) / 800 < 0.3
    assert all(s.input_len == 64 and s.output_len == 2 for s in long)
    assert {s.category for s in specs} == {"long", "interactive"}


def test_sharegpt_filter_and_lengths(tmp_path):
    convs = [{"conversations": [{"from": "human", "value": "q" * 40},
                                {"from": "gpt", "value": "a" * 80}]},
             {"conversations": [{"from": "human", "value": "hi"},       # too short
                                {"from": "gpt", "value": "a" * 80}]},
             {"conversations": [{"from": "human", "value": "x" * 40}]},  # one turn
             {"conversations": [{"from": "human", "value": "q" * 5000},  # > 1024 tokens
                                {"from": "gpt", "value": "a" * 80}]}]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(convs))
    cfg = WorkloadConfig(name="sharegpt", dataset=str(path))
    specs = take(cfg, 3)
    assert all(s.prompt == "q" * 40 and s.input_len == 10 and s.output_len == 20
               for s in specs)                                      # ~4 chars a token
    fixed = WorkloadConfig(name="sharegpt", dataset=str(path), output_len_from_dataset=False,
                           output_len=LengthDist("fixed", 5))
    assert take(fixed, 1)[0].output_len == 5
    with pytest.raises(ValueError):
        WorkloadConfig(name="sharegpt")


def test_trace_replay_clock_and_shared_blocks(tmp_path):
    rows = [{"timestamp": 1000, "input_length": 10, "output_length": 3, "hash_ids": [1, 2]},
            {"timestamp": 1500, "input_length": 7, "output_length": 4, "hash_ids": [1, 3]},
            {"timestamp": 3000, "prompt": "hello world again", "max_tokens": 2,
             "category": "chat"}]
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    cfg = WorkloadConfig(name="trace", dataset=str(path), trace_time_scale=0.001,
                         trace_speed=2.0, trace_block_size=4)
    a, b, c = take(cfg, 10)   # finite: three specs
    assert [s.arrival for s in (a, b, c)] == [0.0, 0.25, 1.0]
    assert (a.input_len, len(a.prompt), b.input_len, len(b.prompt)) == (10, 10, 7, 7)
    assert a.prompt[:4] == b.prompt[:4] and a.prompt[4:7] != b.prompt[4:7]
    assert (a.output_len, b.output_len, c.output_len) == (3, 4, 2)
    assert c.category == "chat" and c.prompt == "hello world again"


def test_arrivals():
    assert list(itertools.islice(arrival_offsets(math.inf), 3)) == [0.0, 0.0, 0.0]
    const = list(itertools.islice(arrival_offsets(4.0, math.inf), 4))
    assert const == pytest.approx([0.25, 0.5, 0.75, 1.0])
    for k in (1.0, 0.5, 4.0):
        offs = list(itertools.islice(arrival_offsets(10.0, k, seed=1), 20000))
        gaps = np.diff([0.0, *offs])
        assert gaps.mean() == pytest.approx(0.1, rel=0.05)
        assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(k), rel=0.07)
    assert list(itertools.islice(arrival_offsets(3.0, seed=5), 5)) == list(
        itertools.islice(arrival_offsets(3.0, seed=5), 5))
    assert parse_rates("1, 2.5,inf") == [1.0, 2.5, math.inf]
    for bad in ("0", "-1"):
        with pytest.raises(ValueError):
            parse_rate(bad)


def test_exact_text_with_a_tokenizer(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token=None))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "</s>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    text = ["the quick brown fox jumps over the lazy dog " * 20, "serving tokens fast " * 30]
    tok.train_from_iterator(text, trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    loaded = load_tokenizer(tmp_path)
    maker = PromptMaker("text", loaded)
    assert maker.id_range[0] == 2                     # past the two special tokens
    rng = np.random.default_rng(0)
    for n in (1, 17, 64):
        prompt, count = maker.make(rng, n)
        assert count == n and len(loaded.encode(prompt, add_special_tokens=False).ids) == n
