from sandboxd.cli.main import main

raise SystemExit(main())
