"""`tandem` argument handling: config files (YAML / TOML) under command-line flags."""

import pytest

from cli.main import apply_config_file, build_parser

pytestmark = pytest.mark.unit


def parse(argv):
    parser = build_parser()
    args = parser.parse_args(argv)
    sub = next(a for a in parser._actions if a.dest == "command").choices["serve"]
    apply_config_file(args, sub, argv)
    return args


def test_yaml_config_fills_options_and_flags_win(tmp_path):
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("prefill: 3\ndecode: 2\nmax-num-seqs: 64\napi_key: [k1, k2]\ncolocated: true\n")
    args = parse(["serve", "--config", str(cfg), "--decode", "1"])
    assert (args.prefill, args.decode, args.max_num_seqs, args.api_key, args.colocated) == (
        3,
        1,
        64,
        ["k1", "k2"],
        True,
    )


def test_flag_equal_to_the_default_still_wins_over_the_file(tmp_path):
    cfg = tmp_path / "serve.toml"
    cfg.write_text('decode = 4\ntransport = "tcp"\n')
    args = parse(["serve", "--config", str(cfg), "--decode=1"])
    assert (args.decode, args.transport) == (1, "tcp")


def test_unknown_key_in_config_is_an_error(tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("prefil: 2\n")
    with pytest.raises(SystemExit, match="unknown option 'prefil'"):
        parse(["serve", "--config", str(cfg)])


def test_scale_needs_a_size(capsys):
    from cli.main import main

    assert main(["scale"]) == 2
    assert capsys.readouterr().err == "tandem scale: error: give --prefill N and/or --decode M\n"


def test_status_and_scale_help_name_their_defaults_and_environment(capsys):
    from cli.main import main

    for command in ("status", "scale"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert "env TANDEM_URL" in text and "http://127.0.0.1:8000" in text and "env TANDEM_ADMIN_KEY" in text
    with pytest.raises(SystemExit):
        main(["scale", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--wait" in text and "default: unchanged" in text and "default: 600" in text


PROFILE = """
profile: {made_by: tandem tune}
max-num-seqs: 32
classes:
  interactive: {slo-ttft-ms: 800, slo-tpot-ms: 80}
  batch: {slo-ttft-ms: 60000}
workload:
  prompt_tokens: {p50: 60, p90: 90}
  output_tokens: {p50: 32, p90: 32}
  arrival_rate: 4.0
  prefix_hit_rate: 0.1
  batch_share: 0.0
"""


def test_a_profile_carries_per_class_slos_and_the_workload_it_was_tuned_for(tmp_path):
    cfg = tmp_path / "profile.yaml"
    cfg.write_text(PROFILE)
    args = parse(["serve", "--config", str(cfg), "--slo-tpot-ms", "70"])
    assert (args.max_num_seqs, args.slo_ttft_ms, args.slo_tpot_ms, args.batch_slo_ttft_ms) == (32, 800, 70, 60000)
    assert args.batch_slo_tpot_ms == 500.0  # not in the profile: the default
    assert args.workload["prompt_tokens"] == {"p50": 60, "p90": 90}


@pytest.mark.parametrize("bad, message", [
    ("classes: {urgent: {slo-ttft-ms: 1}}", r"classes\.urgent\.\[key\]: Input should be 'interactive' or 'batch'"),
    ("classes: {batch: {slo-e2e-ms: 1}}", r"classes\.batch\.slo-e2e-ms: Extra inputs are not permitted"),
    ("workload: {prompt_tokens: {p50: 1, p90: 2}}", r"workload\.output_tokens: Field required; workload\.arrival_rate"),
    (PROFILE.replace("arrival_rate: 4.0", "arrival_rate: 0"), r"workload\.arrival_rate: Input should be greater"),
    ("[1, 2]", "expected a mapping of options"),
])
def test_a_bad_profile_says_what_is_wrong(tmp_path, bad, message):
    from cli.checks import CommandError

    cfg = tmp_path / "bad.yaml"
    cfg.write_text(bad)
    with pytest.raises(CommandError, match=message):
        parse(["serve", "--config", str(cfg)])


def test_status_says_how_far_the_traffic_drifted():
    from cli.main import _drift_line

    assert _drift_line(None) == "traffic drift: not reported by this router"
    waiting = {"drift": None, "reference": None, "live": None, "min_requests": 50, "window_s": 600}
    assert _drift_line(waiting) == "traffic drift: not judged yet (no reference yet; it needs 50)"
    judged = {"drift": {"prompt_tokens": 2.5, "batch_share": 0.2}, "reference_source": "profile",
              "reference": {}, "live": {"requests": 80}, "min_requests": 50, "window_s": 600}
    assert _drift_line(judged) == ("traffic drift from the profile (1.0 = outside it): prompt_tokens 2.50, "
                                   "batch_share 0.20; outside the profile")


def test_test_file_names_are_unique_across_the_test_folders():
    """tests/ has no __init__.py: pytest imports test files by basename, and two with one
    name stop the whole run at collection."""
    from collections import Counter
    from pathlib import Path

    names = Counter(p.name for p in (Path(__file__).parents[1]).rglob("test_*.py"))
    assert [n for n, k in names.items() if k > 1] == []


@pytest.mark.parametrize("argv, want", [
    ([], 64), (["--device", "cuda"], 16), (["--device", "cuda:1"], 16),
    (["--block-size", "32"], 32), (["--device", "cuda", "--block-size", "128"], 128)])
def test_block_size_defaults_by_device_and_a_flag_wins(argv, want):
    from worker_runtime.engine_args import engine_config_from_args

    assert engine_config_from_args(parse(["serve", *argv])).cache.block_size == want


@pytest.mark.parametrize("argv, want", [
    ([], None), (["--device", "cuda"], None), (["--cuda-graphs"], True), (["--enforce-eager"], False)])
def test_decode_graphs_are_on_where_they_can_run_unless_turned_off(argv, want):
    from worker_runtime.engine_args import engine_config_from_args

    assert engine_config_from_args(parse(["serve", *argv])).device.cuda_graphs is want


def test_cuda_graphs_and_enforce_eager_exclude_each_other(capsys):
    with pytest.raises(SystemExit):
        parse(["serve", "--cuda-graphs", "--enforce-eager"])
    assert "not allowed with argument" in capsys.readouterr().err


@pytest.mark.parametrize("argv, want", [([], None), (["--async-scheduling"], True), (["--no-async-scheduling"], False)])
def test_async_scheduling_is_the_engines_choice_unless_a_flag_says(argv, want):
    from worker_runtime.engine_args import engine_config_from_args

    assert engine_config_from_args(parse(["serve", *argv])).scheduler.async_scheduling is want


def test_async_scheduling_flags_exclude_each_other_and_a_config_file_sets_it(capsys, tmp_path):
    from worker_runtime.engine_args import engine_config_from_args

    with pytest.raises(SystemExit):
        parse(["serve", "--async-scheduling", "--no-async-scheduling"])
    assert "not allowed with argument" in capsys.readouterr().err
    cfg = tmp_path / "c.yaml"
    cfg.write_text("async-scheduling: false\n")
    assert engine_config_from_args(parse(["serve", "--config", str(cfg)])).scheduler.async_scheduling is False


def test_a_config_file_turns_decode_graphs_off(tmp_path):
    from worker_runtime.engine_args import engine_config_from_args

    cfg = tmp_path / "c.yaml"
    cfg.write_text("cuda-graphs: false\n")
    assert engine_config_from_args(parse(["serve", "--config", str(cfg)])).device.cuda_graphs is False


@pytest.mark.parametrize("argv", [["serve"], ["router", "--address", "auto"]])
def test_every_router_command_knows_the_grammar_limit(argv):
    """`tandem router` builds the same app as `tandem serve` and reads the same limits
    (it once lacked --max-grammar-bytes and failed at start)."""
    args = build_parser().parse_args(argv)
    assert args.max_grammar_bytes == 256 * 1024 and args.grammar_compile_timeout_s == 10.0
    args = build_parser().parse_args([*argv, "--max-grammar-bytes", "1024"])
    assert args.max_grammar_bytes == 1024


def test_vllm_spellings_mean_what_they_mean_in_vllm(monkeypatch):
    """`vllm serve`'s forms of what tandem has: a positional model, --dtype half/float,
    --(no-)enable-prefix-caching / --(no-)enable-chunked-prefill, several served names,
    --speculative-config JSON (n-gram lengths included), --enable-auto-tool-choice with
    a parser, and the API key from VLLM_API_KEY."""
    from cli.main import vllm_spellings
    from worker_runtime.engine_args import engine_config_from_args

    monkeypatch.delenv("TANDEM_API_KEY", raising=False)
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    a = parse(["serve", "/models/qwen", "--dtype", "half", "--enable-prefix-caching", "--no-enable-chunked-prefill",
               "--served-model-name", "a", "b", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
               "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 6}'])
    vllm_spellings(a)
    cfg = engine_config_from_args(a)
    assert (a.model, a.served_model_name, a.api_key) == ("/models/qwen", ["a", "b"], ["from-env"])
    assert cfg.dtype == "float16" and cfg.cache.enable_prefix_caching and not cfg.scheduler.enable_chunked_prefill
    spec = cfg.speculative
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max) == (
        "ngram", 5, 2, 6)
    off = parse(["serve", "--no-enable-prefix-caching", "--dtype", "float"])
    assert not engine_config_from_args(off).cache.enable_prefix_caching and engine_config_from_args(off).dtype == \
        "float32"
    draft = parse(["serve", "--speculative-config", '{"model": "/models/draft", "num_speculative_tokens": 3}'])
    vllm_spellings(draft)
    assert (draft.speculative_method, draft.speculative_model) == ("draft", "/models/draft")


@pytest.mark.parametrize("argv, says", [
    (["--speculative-config", '{"method": "eagle"}'], "method 'eagle'"),
    (["--speculative-config", '{"method": "ngram", "draft_tensor_parallel_size": 1}'], "does not take"),
    (["--speculative-config", "ngram"], "not JSON"),
])
def test_vllm_forms_tandem_lacks_are_refused_with_what_it_has(argv, says, capsys):
    with pytest.raises(SystemExit):
        parse(["serve", *argv])
    assert says in capsys.readouterr().err


def test_vllm_forms_that_clash_are_refused():
    from cli.checks import CommandError
    from cli.main import vllm_spellings

    for argv in (["/m", "--model", "/other"], ["--enable-auto-tool-choice"],
                 ["--speculative-config", '{"method": "ngram"}', "--speculative-method", "suffix"]):
        with pytest.raises(CommandError):
            vllm_spellings(parse(["serve", *argv]))


def test_kv_tier_options_reach_the_engine_config():
    from worker_runtime.engine_args import engine_config_from_args

    cache = engine_config_from_args(parse(["serve", "--kv-offload-host-gb", "2", "--kv-offload-disk-path", "/nvme",
                                           "--kv-offload-disk-gb", "50", "--swap-space", "4"])).cache
    assert (cache.offload_host_gb, cache.offload_disk_path, cache.offload_disk_gb, cache.swap_space_gb) == \
        (2.0, "/nvme", 50.0, 4.0)


@pytest.mark.parametrize("argv", [["--trust-remote-code"], ["-pp", "2"], ["--download-dir", "/x"]])
def test_vllm_options_tandem_does_not_take_are_refused_by_name_with_a_reason(argv, capsys):
    with pytest.raises(SystemExit):
        parse(["serve", *argv])
    err = capsys.readouterr().err
    assert argv[0] in err and "unrecognized" not in err
