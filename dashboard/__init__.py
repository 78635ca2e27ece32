"""Live web dashboard of one service instance: `python -m dashboard --config FILE [--port N]`.

It runs the instance's metrics collector itself, so it must be the only collector of the instance
(`streamasr top` reads from it over HTTP when it is up).
"""

import argparse


def port_number(text: str) -> int:
    """`--port` for argparse: a port out of range is refused with the usage, not a traceback at bind."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port must be 0 to 65535, not {value}")
    return value
