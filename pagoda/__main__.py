from pagoda.api.cli import main

raise SystemExit(main())
