"""Flags as a user typed them: the one meant by a mistyped flag, and the flag of each config field an error names."""

from __future__ import annotations

import argparse
import difflib
import re
from collections.abc import Sequence


def unrecognized(unknown: Sequence[str], command: argparse.ArgumentParser) -> str:
    """argparse's "unrecognized arguments", with the command's flag each mistyped one is closest to."""
    known = [o for action in command._actions for o in action.option_strings if o.startswith("--")]  # noqa: SLF001
    guesses = []
    for arg in unknown:
        flag = arg.split("=", 1)[0]
        if flag.startswith("--"):
            # Fewest typos first (a swapped pair counts as one: --prot is --port), then likeness.
            ranked = sorted(known, key=lambda o: (_typos(flag, o), -difflib.SequenceMatcher(None, flag, o).ratio()))
            if ranked and _typos(flag, ranked[0]) <= max(1, len(flag) // 4):
                guesses.append(f"{flag}: did you mean {ranked[0]}?")
    hint = f" ({'; '.join(guesses)})" if guesses else ""
    return f"unrecognized arguments: {' '.join(unknown)}{hint}"


def _typos(a: str, b: str) -> int:
    """Edits from `a` to `b`: insertions, deletions, substitutions and swaps of neighbours (optimal string alignment)."""
    d = [[i + j if i * j == 0 else 0 for j in range(len(b) + 1)] for i in range(len(a) + 1)]
    for i in range(1, len(a) + 1):
        for j in range(1, len(b) + 1):
            d[i][j] = min(d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + (a[i - 1] != b[j - 1]))
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                d[i][j] = min(d[i][j], d[i - 2][j - 2] + 1)
    return d[len(a)][len(b)]


# ServeConfig fields whose flag is not spelled after them (a test checks every field has one).
_FLAG_OF_FIELD = {
    "upload_timeout_seconds": "--upload-timeout",
    "admission_wait_seconds": "--admission-wait",
    "shm_root": "--shm-dir",
    "notice_window_seconds": "--notice-window",
    "s3_url": "--root",
    "fsync": "--no-fsync",
    "group_commit": "--no-group-commit",
}


def with_flags(message: str, serve: argparse.ArgumentParser) -> str:
    """A ServeConfig error, with the flags a user typed instead of the config's field names.

    The config is validated once, in the core, which knows no flags; here each
    field it names (`keep_last`, `tls_cert`) becomes its flag (`--keep-last`).
    """
    flags = dict(_FLAG_OF_FIELD)
    for action in serve._actions:  # noqa: SLF001 - argparse offers no public list
        longs = [o for o in action.option_strings if o.startswith("--")]
        if longs:
            flags.setdefault(action.dest, longs[0])

    def flag(match: re.Match[str]) -> str:
        return flags.get(match[0], match[0])

    # Fields with an underscore anywhere (digits too: s3_read_timeout); one-word
    # fields (port, host) only where they start the message, so plain words stay words.
    message = re.sub(r"\b[a-z][a-z0-9]*(?:_[a-z0-9]+)+\b", flag, message)
    return re.sub(r"^[a-z]+\b", flag, message)


class NoTokenOnCommandLine(argparse.Action):
    """`--token`: refused without echoing its value (argparse's own error would)."""

    def __call__(self, parser: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
        parser.error(
            "tokens never go on the command line (ps and shell history show them): "
            "use --token-file FILE or the environment variable instead"
        )
