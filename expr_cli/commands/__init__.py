"""One module per `expr` command (or command group): parse arguments, call the library, hand data to `expr_cli.render`."""
