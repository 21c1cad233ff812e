from realrun.app import cli

cli()
