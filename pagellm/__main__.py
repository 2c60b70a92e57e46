from pagellm.entrypoints.cli.main import main

main()
