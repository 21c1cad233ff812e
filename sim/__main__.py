from sim.app import cli

cli()
