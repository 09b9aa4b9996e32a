"""The help formatter of every hetermoe command's parser."""
from __future__ import annotations

import argparse


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The formatter of every hetermoe parser: descriptions keep their line breaks and every
    flag's help ends with its default, unless the help already says what the default is."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("default" in text.lower() or action.default is argparse.SUPPRESS or action.required
                or action.dest in ("help", "version")):
            return text
        if not action.option_strings and action.nargs not in (argparse.OPTIONAL, argparse.ZERO_OR_MORE):
            return text  # a required positional has no default
        if action.nargs == 0 and isinstance(action.default, bool):  # store_true / store_false
            return f"{text} (default: {'on' if action.default else 'off'})"
        if action.default is None:
            return f"{text} (default: not set)"
        return f"{text} (default: %(default)s)"
