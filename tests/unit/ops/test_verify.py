"""Save manifests and `checkpointd verify`, on real files, without TensorFlow.

Also the parsing side of the upload deadline (`--upload-timeout`), which the
daemon tier exercises in tests/integration/faults/test_faults.py.
"""

from __future__ import annotations

import io
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import crc32c
import pytest

from checkpointd.cli import VerifyCommand, config_from_args, main, verify
from checkpointd.core.config import ServeConfig
from checkpointd.storage import save_manifest
from checkpointd.storage.verify import find_prefixes, find_save_dirs, verify_dir
from tests.terminal import stderr_on_a_terminal

MANIFEST = save_manifest.MANIFEST_NAME
SUBPROCESS_LIMIT = 30.0

# A SavedModel's shape; contents are arbitrary bytes, verify never parses them.
SAVED_MODEL = {
    "saved_model.pb": b"graph" * 100,
    "fingerprint.pb": b"fp",
    "policy_specs.pbtxt": b"specs",
    "variables/variables.index": b"index",
    "variables/variables.data-00000-of-00001": bytes(range(256)) * 40,
}


def make_save(
    path: Path, files: dict[str, bytes] | None = None, known: dict[str, tuple[int, int]] | None = None
) -> Path:
    files = SAVED_MODEL if files is None else files
    for rel, data in files.items():
        (path / rel).parent.mkdir(parents=True, exist_ok=True)
        (path / rel).write_bytes(data)
    (path / "assets").mkdir(exist_ok=True)  # an empty dir, as tf.saved_model.save makes
    save_manifest.write_manifest(
        path,
        run="run1",
        kind="saved_model",
        step=7,
        export_dir=path.name,
        versions={"checkpointd": "0.1.0", "tensorflow": "2.15.1"},
        known=known,
        created=1_700_000_000.5,
    )
    return path


def test_manifest_lists_every_other_file_with_size_and_crc32c(tmp_path: Path) -> None:
    save = make_save(tmp_path / "policy_7")
    document = json.loads((save / MANIFEST).read_text())

    assert document["format"] == save_manifest.FORMAT
    assert document["format_version"] == save_manifest.FORMAT_VERSION == 1
    assert (document["run"], document["kind"], document["step"], document["export_dir"]) == (
        "run1", "saved_model", 7, "policy_7",
    )  # fmt: skip
    assert document["created_unix_seconds"] == 1_700_000_000.5
    assert document["versions"] == {"checkpointd": "0.1.0", "tensorflow": "2.15.1"}
    assert document["files"] == [
        {"path": rel, "size": len(data), "crc32c": f"{crc32c.crc32c(data):08x}"}
        for rel, data in sorted(SAVED_MODEL.items())
    ]


def test_manifest_has_a_line_per_field_and_per_file_and_reads_back_as_written(tmp_path: Path) -> None:
    extra = {"chunks": {"tensors": [{"key": "a", "shape": [2, 3], "crc32c": "KDPINA=="}]}, "note": 'ü \\ "'}
    save = tmp_path / "s"
    make_save(save)
    (save / MANIFEST).unlink()
    save_manifest.write_manifest(
        save, run="r", kind="saved_model", step=1, export_dir="s", versions={"tensorflow": "2.15.1"}, extra=extra
    )
    data = (save / MANIFEST).read_bytes()
    document = save_manifest.parse_manifest(data)
    lines = data.decode("utf-8").splitlines()

    assert json.loads(data)["chunks"] == extra["chunks"] and document["note"] == extra["note"]
    assert [e.path for e in document["files"]] == sorted(SAVED_MODEL)
    # One line a top-level field, one a file entry: `{`, 11 fields, `]` closing the files, `}`.
    assert len(lines) == 1 + 11 + len(SAVED_MODEL) + 1 + 1
    assert lines[0] == "{" and lines[-1] == "}" and data.endswith(b"}\n")
    assert sum(line.strip().startswith('{"path": ') for line in lines) == len(SAVED_MODEL)


def test_manifest_is_not_written_over_an_existing_one(tmp_path: Path) -> None:
    save = make_save(tmp_path / "s")
    with pytest.raises(FileExistsError):
        make_save(save)


@pytest.mark.parametrize("kind", ["file-symlink", "dir-symlink", "fifo"])
def test_a_manifest_is_refused_for_a_save_holding_anything_but_regular_files(tmp_path: Path, kind: str) -> None:
    odd = tmp_path / "s" / "variables" / "odd"
    odd.parent.mkdir(parents=True)
    {
        "file-symlink": lambda: odd.symlink_to(tmp_path / "elsewhere"),
        "dir-symlink": lambda: odd.symlink_to(tmp_path, target_is_directory=True),
        "fifo": lambda: os.mkfifo(odd),
    }[kind]()
    with pytest.raises(OSError, match=f"{odd} is not a regular file"):
        make_save(tmp_path / "s")
    assert not (tmp_path / "s" / MANIFEST).exists()


def test_known_checksums_are_used_only_when_the_size_agrees(tmp_path: Path) -> None:
    # A deliberately wrong known CRC shows it was used instead of reading the file.
    size = len(SAVED_MODEL["saved_model.pb"])
    used = make_save(tmp_path / "used", known={"saved_model.pb": (size, 0xDEADBEEF)})
    ignored = make_save(tmp_path / "ignored", known={"saved_model.pb": (size + 1, 0xDEADBEEF)})

    def crc_of(save: Path) -> str:
        files = json.loads((save / MANIFEST).read_text())["files"]
        return next(f["crc32c"] for f in files if f["path"] == "saved_model.pb")

    assert crc_of(used) == "deadbeef"
    assert crc_of(ignored) == f"{crc32c.crc32c(SAVED_MODEL['saved_model.pb']):08x}"


def test_a_complete_save_verifies(tmp_path: Path) -> None:
    report = verify_dir(make_save(tmp_path / "s"))
    assert report.ok, report.reason
    assert (report.run, report.kind, report.step) == ("run1", "saved_model", 7)
    assert report.files == len(SAVED_MODEL)
    assert report.bytes == sum(map(len, SAVED_MODEL.values()))


DATA = "variables/variables.data-00000-of-00001"


def _flip_a_byte(save: Path) -> None:
    data = bytearray((save / DATA).read_bytes())
    data[1000] ^= 0x01
    (save / DATA).write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (_flip_a_byte, f"{DATA} has CRC32C"),
        (
            lambda s: (s / DATA).write_bytes((s / DATA).read_bytes()[:-1]),
            f"{DATA} has 10239 bytes, the manifest says 10240",
        ),
        (lambda s: (s / "variables/variables.index").unlink(), "variables/variables.index is missing"),
        (lambda s: (s / "assets" / "extra.txt").write_text("x"), "assets/extra.txt is not in the manifest"),
        (lambda s: (s / MANIFEST).unlink(), f"no {MANIFEST}"),
        (lambda s: (s / MANIFEST).write_text("{not json"), f"{MANIFEST} is unreadable"),
        (lambda s: (s / MANIFEST).write_text('{"format": "other"}'), "is not a checkpointd.save-manifest"),
        (
            lambda s: (s / "variables.index").symlink_to(s / "variables/variables.index"),
            "variables.index is not in the manifest",
        ),
    ],
    ids=["flipped-bit", "truncated", "missing", "extra", "no-manifest", "bad-json", "other-format", "symlink"],
)
def test_damage_is_reported_with_its_reason(tmp_path: Path, damage, reason: str) -> None:  # noqa: ANN001
    save = make_save(tmp_path / "s")
    damage(save)
    report = verify_dir(save)
    assert not report.ok
    assert reason in report.reason


def test_a_link_in_a_saves_path_is_reported_never_read_through(tmp_path: Path) -> None:
    save = make_save(tmp_path / "s")
    decoy = tmp_path / "decoy"
    (save / "variables").rename(decoy)  # the save's own files, moved out, are what the link leads to
    (save / "variables").symlink_to(decoy, target_is_directory=True)
    report = verify_dir(save)
    assert not report.ok
    assert f"{DATA} is missing ('variables' is a symlink, not followed)" in report.reason, report.reason
    # A manifest that is a link is not read either.
    (save / MANIFEST).rename(tmp_path / "manifest")
    (save / MANIFEST).symlink_to(tmp_path / "manifest")
    assert f"{MANIFEST} is a symlink" in verify_dir(save).reason


def test_a_newer_format_or_an_escaping_path_is_refused(tmp_path: Path) -> None:
    save = make_save(tmp_path / "s")
    document = json.loads((save / MANIFEST).read_text())
    (save / MANIFEST).write_text(json.dumps({**document, "format_version": 2}))
    assert "format_version 2" in verify_dir(save).reason

    document["files"][0]["path"] = "../outside"
    (save / MANIFEST).write_text(json.dumps(document))
    assert "invalid or repeated path '../outside'" in verify_dir(save).reason


def test_many_problems_are_summarized(tmp_path: Path) -> None:
    save = make_save(tmp_path / "s")
    for rel in SAVED_MODEL:
        (save / rel).unlink()
    reason = verify_dir(save).reason
    assert reason.count("is missing") == 3
    assert reason.endswith("(and 2 more)")


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A daemon root: two good saves, one damaged, one without a manifest, and noise."""
    root = tmp_path / "root"
    make_save(root / "runA" / "policy_1")
    make_save(root / "runA" / "nested" / "policy_2")
    _flip_a_byte(make_save(root / "runB" / "policy_3"))
    (root / "runB" / "foreign" / "variables").mkdir(parents=True)
    (root / "runB" / "foreign" / "variables" / "variables.index").write_bytes(b"i")
    make_save(root / "runA" / ".checkpointd-tmp-policy_9-0123456789abcdef")  # unpublished
    (root / ".checkpointd" / "templates").mkdir(parents=True)
    (root / "runA" / "notes").mkdir()
    return root


def test_save_dirs_are_found_recursively_skipping_daemon_dirs(root: Path) -> None:
    found = find_save_dirs(root)
    assert [p.relative_to(root).as_posix() for p in found] == [
        "runA/nested/policy_2",
        "runA/policy_1",
        "runB/foreign",
        "runB/policy_3",
    ]
    assert find_save_dirs(root / "runA" / "policy_1") == [root / "runA" / "policy_1"]
    assert find_save_dirs(root / "runA" / "policy_1" / MANIFEST) == [root / "runA" / "policy_1"]


def test_a_dir_named_like_the_manifest_is_searched_and_not_taken_for_one(tmp_path: Path) -> None:
    """A training run may write its checkpoints in a dir named checkpointd.manifest.json (a valid
    export dir component). Its parent is then no save, and the checkpoints in both are found: the daemon's dir state files, GetLatest and retention read them through these searches
    (found by the fuzz: such a dir's checkpoints got no `checkpoint` state file, and its parent's
    went unseen)."""
    folder = tmp_path / "fz-t"
    inner = folder / "p0" / MANIFEST
    inner.mkdir(parents=True)
    for directory, name in ((folder / "p0", "ckpt-2"), (inner, "ckpt-43")):
        (directory / f"{name}.index").write_bytes(b"i")
        (directory / f"{name}{save_manifest.PREFIX_MANIFEST_SUFFIX}").write_text("{}")

    assert set(find_prefixes(folder)) == {folder / "p0" / "ckpt-2", inner / "ckpt-43"}
    assert find_prefixes(inner) == [inner / "ckpt-43"]
    assert find_save_dirs(folder) == []


def test_cli_prints_ok_and_failed_per_dir_and_exits_1(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", str(root)]) == 1
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert lines[0] == f"OK      {root}/runA/nested/policy_2 (saved_model, step 7, 5 files, 10752 bytes)"
    assert lines[1].startswith(f"OK      {root}/runA/policy_1 ")
    assert lines[2] == f"FAILED  {root}/runB/foreign: no {MANIFEST} (not a checkpointd save, or not complete)"
    assert lines[3].startswith(f"FAILED  {root}/runB/policy_3: {DATA} has CRC32C ")
    assert lines[4] == "2 OK, 2 FAILED"
    assert err == ""  # no progress: stderr is not a terminal


def test_cli_exits_0_when_all_ok_and_takes_several_paths(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", str(root / "runA" / "policy_1"), str(root / "runA" / "nested")]) == 0
    assert capsys.readouterr().out.endswith("2 OK, 0 FAILED\n")


def test_cli_takes_the_working_dir_as_dot(
    root: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # `cd <root>/<run> && checkpointd verify .`: "." has no name of its own to look beside.
    monkeypatch.chdir(root / "runA")
    assert main(["verify", "."]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "OK      nested/policy_2 (saved_model, step 7, 5 files, 10752 bytes)",
        "OK      policy_1 (saved_model, step 7, 5 files, 10752 bytes)",
        "2 OK, 0 FAILED",
    ]


def test_cli_json(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", "--json", str(root / "runA"), str(root / "runB" / "foreign")]) == 1
    document = json.loads(capsys.readouterr().out)
    assert document["ok"] is False
    assert [(Path(d["path"]).name, d["ok"]) for d in document["dirs"]] == [
        ("policy_2", True), ("policy_1", True), ("foreign", False),
    ]  # fmt: skip
    assert document["dirs"][0]["step"] == 7 and document["dirs"][0]["run"] == "run1"
    assert document["dirs"][2]["reason"].startswith(f"no {MANIFEST}")


def test_cli_a_path_that_does_not_exist_is_a_usage_error_exit_2_and_nothing_is_checked(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["verify", str(root / "runA"), "/nonexistent"]) == 2
    out, err = capsys.readouterr()
    assert out == ""  # not even runA's OK lines: a typo is told before a long check starts
    assert err.startswith("checkpointd verify: /nonexistent: no such file or dir; give a save dir")
    assert "s3://BUCKET" in err


def test_cli_fails_a_dir_without_any_save(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", str(tmp_path)]) == 1
    assert f"no save dirs ({MANIFEST}) found here" in capsys.readouterr().out


def test_cli_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["verify"], ["verify", "--bogus", "x"]):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2
    capsys.readouterr()


def test_progress_reports_saves_bytes_and_rate_checked_on_stderr(tmp_path: Path) -> None:
    big = {**SAVED_MODEL, DATA: b"\x07" * (9 << 20)}
    make_save(tmp_path / "big", big)
    make_save(tmp_path / "small", SAVED_MODEL)
    out, err = io.StringIO(), io.StringIO()
    assert verify.run([tmp_path], progress=True, out=out, err=err) == 0
    shown = err.getvalue()
    assert shown.startswith("\rchecked 0 of 2 saves, ") and shown.endswith("\n")
    last = shown.rstrip("\n").rsplit("\r", 1)[-1].replace("\x1b[K", "")
    assert re.fullmatch(r"checked 2 of 2 saves, 9\.0 of 9\.0 MiB, [\d,.]+ MiB/s", last), last
    assert out.getvalue().splitlines()[-1] == "2 OK, 0 FAILED"


def test_verify_command_parses() -> None:
    command, level = config_from_args(["verify", "a", "b/c", "--json", "--progress"])
    assert command == VerifyCommand((Path("a"), Path("b/c")), as_json=True, progress=True)
    assert level == "WARNING"
    assert config_from_args(["verify", "a"])[0] == VerifyCommand((Path("a"),), False, None)


def test_verify_imports_neither_tensorflow_nor_grpc(root: Path) -> None:
    code = (
        "import sys\n"
        "from checkpointd.cli import main\n"
        f"rc = main(['verify', {str(root / 'runA')!r}])\n"
        "bad = [m for m in ('tensorflow', 'grpc', 'numpy') if m in sys.modules]\n"
        "sys.exit(f'imported {bad}' if bad else rc)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=SUBPROCESS_LIMIT)
    assert done.returncode == 0, done.stderr + done.stdout


def test_verify_entry_point_exit_codes(root: Path) -> None:
    run = [sys.executable, "-m", "checkpointd", "verify"]
    ok = subprocess.run([*run, str(root / "runA")], capture_output=True, text=True, timeout=SUBPROCESS_LIMIT)
    bad = subprocess.run([*run, str(root)], capture_output=True, text=True, timeout=SUBPROCESS_LIMIT)
    usage = subprocess.run(run, capture_output=True, text=True, timeout=SUBPROCESS_LIMIT)
    assert (ok.returncode, bad.returncode, usage.returncode) == (0, 1, 2)

    missing = subprocess.run([*run, "/nonexistent"], capture_output=True, text=True, timeout=SUBPROCESS_LIMIT)
    assert missing.returncode == 2 and "/nonexistent: no such file or dir" in missing.stderr


def test_verify_shows_progress_on_a_terminal_and_nothing_extra_when_piped(tmp_path: Path) -> None:
    for i in range(3):
        make_save(tmp_path / f"save_{i}", {**SAVED_MODEL, DATA: bytes([i]) * (2 << 20)})
    code, out, shown = stderr_on_a_terminal(
        [sys.executable, "-m", "checkpointd", "verify", str(tmp_path)], SUBPROCESS_LIMIT
    )
    assert code == 0 and out.splitlines()[-1] == "3 OK, 0 FAILED"
    assert "\rchecked " in shown and "3 of 3 saves, 6.0 of 6.0 MiB, " in shown and "MiB/s" in shown
    piped = subprocess.run(
        [sys.executable, "-m", "checkpointd", "verify", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_LIMIT,
    )
    assert piped.returncode == 0 and piped.stderr == ""
    assert piped.stdout == out  # the same report either way; only the terminal gets the progress line


# The upload deadline's configuration.


def test_upload_timeout_defaults_to_300_seconds_and_parses() -> None:
    assert ServeConfig().upload_timeout_seconds == 300.0
    config, _ = config_from_args(["serve", "--upload-timeout", "2.5"])
    assert isinstance(config, ServeConfig) and config.upload_timeout_seconds == 2.5


@pytest.mark.parametrize("value", [0.0, -1.0, math.nan, math.inf])
def test_upload_timeout_must_be_positive_and_finite(value: float) -> None:
    with pytest.raises(ValueError, match="upload_timeout_seconds"):
        ServeConfig(upload_timeout_seconds=value)


def test_a_bad_upload_timeout_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        config_from_args(["serve", "--upload-timeout", "0"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "checkpointd serve: error: --upload-timeout must be > 0" in err  # the flag, not the field
    assert err.startswith("usage: checkpointd serve ")


@pytest.mark.parametrize("size", [0, 1, (4 << 20) - 1, 4 << 20, (9 << 20) + 3])
def test_a_mapped_checksum_equals_a_read_one(tmp_path: Path, size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(save_manifest, "_MAP_BYTES", 4 << 20)  # several windows for the larger sizes
    path = tmp_path / "f"
    data = bytes(range(256)) * (size // 256) + bytes(range(size % 256))
    path.write_bytes(data)
    seen: list[int] = []

    assert save_manifest.file_checksum(path, seen.append, mapped=True) == (size, crc32c.crc32c(data))
    assert save_manifest.file_checksum(path) == (size, crc32c.crc32c(data))
    assert sum(seen) == size
