from pagoda.cli.main import main

raise SystemExit(main())
