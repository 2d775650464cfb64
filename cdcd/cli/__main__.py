from cdcd.cli import main

main()
