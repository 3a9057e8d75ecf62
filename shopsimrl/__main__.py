from shopsimrl.cli import main

main()
