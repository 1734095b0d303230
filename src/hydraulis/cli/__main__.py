from hydraulis.cli import main

main()
