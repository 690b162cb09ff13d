"""The `tandem` command line: one process per command (serve, router, controller,
scale, status); `bench`, `tune` and `generate` mount themselves through the
`tandem.commands` entry-point group."""
