"""`tandem` argument handling: config files (YAML / TOML) under command-line flags."""

import pytest

from router.cli import apply_config_file, build_parser

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
    from router.cli import main

    assert main(["scale"]) == 2
    assert capsys.readouterr().err == "tandem scale: error: give --prefill N and/or --decode M\n"


def test_status_and_scale_help_name_their_defaults_and_environment(capsys):
    from router.cli import main

    for command in ("status", "scale"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert "env TANDEM_URL" in text and "http://127.0.0.1:8000" in text and "env TANDEM_ADMIN_KEY" in text
    with pytest.raises(SystemExit):
        main(["scale", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--wait" in text and "default: unchanged" in text and "default: 600" in text
