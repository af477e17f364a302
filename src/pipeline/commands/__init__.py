"""One module per `python -m pipeline` subcommand, each with `main(argv) -> int`."""
