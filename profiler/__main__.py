from profiler.app import cli

cli()
