"""Live web dashboard of one service instance: `python -m dashboard --config FILE [--port N]`.

It runs the instance's metrics collector itself, so it must be the only collector of the instance
(`streamasr top` reads from it over HTTP when it is up).
"""
