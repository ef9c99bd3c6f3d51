"""The CLI: pure parsing into configs, a TensorFlow-free --help, and the status table."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from checkpointd.cli import OpsCommand, config_from_args
from checkpointd.cli.ops import format_status
from checkpointd.core.config import DEFAULT_SHM_ROOT, ServeConfig
from checkpointd.v1 import checkpointd_pb2 as pb

# A subprocess that imports the CLI only; generous for a slow CI machine.
SUBPROCESS_LIMIT = 30.0


def serve(*args: str) -> ServeConfig:
    config, _ = config_from_args(["serve", *args])
    assert isinstance(config, ServeConfig)
    return config


def test_serve_defaults() -> None:
    config, level = config_from_args(["serve"])

    assert config == ServeConfig(shm_root=DEFAULT_SHM_ROOT)  # the CLI names /dev/shm; the server checks it at start
    assert config.root == Path("checkpoints")
    assert config.port == 7431
    assert config.metrics_port == 9431
    assert config.host == "127.0.0.1"
    assert config.fsync is True
    assert config.write_nice == 10
    assert level == "INFO"


def test_serve_options() -> None:
    config, level = config_from_args(
        [
            "serve",
            "--root", "/data/ckpt",
            "--port", "0",
            "--port-file", "/tmp/port",
            "--metrics-port", "0",
            "--grace-seconds", "2.5",
            "--max-workers", "8",
            "--no-fsync",
            "--log-level", "DEBUG",
        ]
    )  # fmt: skip

    assert config == ServeConfig(
        shm_root=DEFAULT_SHM_ROOT,
        root=Path("/data/ckpt"),
        port=0,
        port_file=Path("/tmp/port"),
        metrics_port=0,
        grace_seconds=2.5,
        max_workers=8,
        fsync=False,
    )
    assert level == "DEBUG"


def test_notice_window_is_parsed_with_its_default_and_zero_is_the_old_behaviour() -> None:
    assert serve().notice_window_seconds == ServeConfig().notice_window_seconds == 5.0
    assert serve("--notice-window", "2.5").notice_window_seconds == 2.5
    assert serve("--notice-window", "0").notice_window_seconds == 0


def test_incremental_path_defaults_to_auto_and_takes_a_fixed_way(capsys: pytest.CaptureFixture[str]) -> None:
    assert serve().incremental_path == "auto"
    assert serve("--incremental-path", "receive").incremental_path == "receive"
    with pytest.raises(SystemExit) as raised:
        config_from_args(["serve", "--incremental-path", "fastest"])
    assert raised.value.code == 2 and "--incremental-path" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["-1", "nan", "inf"])
def test_a_bad_notice_window_names_its_flag(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as raised:
        config_from_args(["serve", "--notice-window", value])
    assert raised.value.code == 2
    err = capsys.readouterr().err
    assert "--notice-window must be >= 0 and finite" in err and "notice_window_seconds" not in err, err


def test_metrics_port_minus_one_turns_metrics_off() -> None:
    assert serve("--metrics-port", "-1").metrics_port is None


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("512M", 512 << 20),
        ("512m", 512 << 20),
        ("512MiB", 512 << 20),
        ("512MB", 512 << 20),
        ("8G", 8 << 30),
        ("1.5G", 3 << 29),
        ("64k", 64 << 10),
        ("1T", 1 << 40),
        ("1000", 1000),
    ],
)
def test_sizes_take_units(text: str, size: int) -> None:
    config = serve("--max-snapshot-bytes", text, "--max-template-bytes", text)
    assert config.max_snapshot_bytes == size
    assert config.max_template_bytes == size


@pytest.mark.parametrize(
    "args",
    [
        ["--port", "70000"],
        ["--port", "-1"],
        ["--port", "http"],
        ["--metrics-port", "65536"],
        ["--max-snapshot-bytes", "lots"],
        ["--max-snapshot-bytes", "0"],
        ["--grace-seconds", "-1"],
        ["--grace-seconds", "nan"],
        ["--grace-seconds", "inf"],
        ["--max-workers", "0"],
        ["--log-level", "LOUD"],
        ["--write-nice", "20"],
        ["--write-nice", "-1"],
        ["--unknown"],
    ],
    ids=" ".join,
)
def test_bad_serve_arguments_exit_2(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as raised:
        config_from_args(["serve", *args])

    assert raised.value.code == 2
    assert "checkpointd" in capsys.readouterr().err


@pytest.mark.parametrize("text", ["infG", "1e400M"])
def test_an_infinite_size_is_a_usage_error(text: str) -> None:
    with pytest.raises(SystemExit) as raised:
        config_from_args(["serve", "--max-snapshot-bytes", text])
    assert raised.value.code == 2


@pytest.mark.parametrize("name", ["flush", "status", "close"])
def test_ops_commands(name: str) -> None:
    command, level = config_from_args([name, "--address", "daemon:1234", "--run", "r1", "--timeout", "3"])

    assert command == OpsCommand(name, "daemon:1234", "r1", 3.0, False)
    assert level == "WARNING"


def test_ops_defaults_cover_all_runs_with_no_limit() -> None:
    command, _ = config_from_args(["flush"])
    assert command == OpsCommand("flush", "127.0.0.1:7431", None, None, False)


def test_status_json() -> None:
    command, _ = config_from_args(["status", "--json"])
    assert isinstance(command, OpsCommand) and command.as_json


@pytest.mark.parametrize(
    "argv",
    [
        ["close"],
        ["flush", "--timeout", "0"],
        ["status", "--timeout", "-2"],
        ["flush", "--json"],
        [],
    ],
    ids=" ".join,
)
def test_bad_ops_arguments_exit_2(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as raised:
        config_from_args(argv)
    assert raised.value.code == 2


def test_help_runs_without_tensorflow() -> None:
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "checkpointd", "--help"],
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_LIMIT,
    )

    assert done.returncode == 0, done.stderr
    for command in ("serve", "flush", "status", "close"):
        assert command in done.stdout
    # -X importtime writes "import time: self | cumulative | module" lines to stderr.
    imported = [line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if "|" in line]
    assert "checkpointd.cli" in imported  # the import log is really there
    assert not [m for m in imported if m.split(".")[0] in ("tensorflow", "tf_agents")]


def test_main_help_in_process_leaves_tensorflow_unimported() -> None:
    snippet = (
        "import sys\n"
        "from checkpointd import cli\n"
        "try:\n"
        "    cli.main(['--help'])\n"
        "except SystemExit as e:\n"
        "    assert e.code == 0, e.code\n"
        "print('tensorflow' in sys.modules, 'tf_agents' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, timeout=SUBPROCESS_LIMIT)

    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "False False"


# --- the status table ---------------------------------------------------------------------

NOW = 1_700_000_000.0


def status_reply() -> pb.StatusResponse:
    return pb.StatusResponse(
        runs=[
            pb.RunStatus(
                run="cartpole-dqn",
                state="open",
                in_flight=pb.InFlightSave(
                    kind=pb.SAVED_MODEL,
                    export_dir="policies/step_300",
                    step=300,
                    started_unix_seconds=NOW - 12,
                    waiting=2,
                ),
                saves_ok=7,
                saves_skipped=3,
                saves_failed=1,
                last_success=pb.LastSuccess(
                    kind=pb.CHECKPOINT,
                    path="/ckpt/cartpole-dqn/train",
                    step=200,
                    unix_seconds=NOW - 600,
                ),
            ),
            pb.RunStatus(run="fresh-run", state="closed"),
        ]
    )


def test_format_status_shows_runs_states_counts_and_in_flight() -> None:
    text = format_status(status_reply(), now=NOW)
    header, busy, fresh = text.splitlines()

    assert header.split()[:2] == ["RUN", "STATE"]
    assert busy.startswith("cartpole-dqn") and " open " in busy
    assert "saved_model policies/step_300 (step 300, 12s ago) +2 waiting" in busy
    assert "  7  " in busy and "  3  " in busy and "  1  " in busy
    assert busy.endswith("10m ago step 200 /ckpt/cartpole-dqn/train")
    assert fresh.startswith("fresh-run") and " closed " in fresh
    assert fresh.endswith("never")
    assert " - " in fresh  # nothing in flight
    # Columns line up: every row's IN FLIGHT column starts at the same offset.
    assert busy.index("saved_model") == header.index("IN FLIGHT") == fresh.index(" - ") + 1


def test_format_status_with_no_runs_and_draining() -> None:
    text = format_status(pb.StatusResponse(draining=True), now=NOW)

    assert "(no runs registered)" in text
    assert text.splitlines()[-1] == "daemon is draining: new saves are refused"


def test_format_status_on_notice_says_which_saves_are_still_taken_and_for_how_long() -> None:
    text = format_status(pb.StatusResponse(runs=status_reply().runs, draining=True, notice_seconds_left=3.21), now=NOW)

    assert text.splitlines()[-1] == (
        "daemon is draining (on notice): new runs are refused; saves of the runs above are taken for 3.2s more"
    )
    assert "draining" not in format_status(status_reply(), now=NOW)


def test_upload_limits_parse_with_sizes_and_default_to_the_machine() -> None:
    config, _ = config_from_args(["serve", "--max-concurrent-uploads", "4", "--max-staging-bytes", "2G"])
    assert config.max_concurrent_uploads == 4 and config.max_staging_bytes == 2 << 30
    default, _ = config_from_args(["serve"])
    assert default.max_concurrent_uploads == 32 and default.max_staging_bytes is None
    with pytest.raises(SystemExit) as exit_info:
        config_from_args(["serve", "--max-concurrent-uploads", "0"])
    assert exit_info.value.code == 2
