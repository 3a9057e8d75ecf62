"""Command line (placeholder until the commands land)."""


def main() -> None:
    raise SystemExit("shopsimrl: CLI not yet wired")
