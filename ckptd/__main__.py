from ckptd.cli.main import main

raise SystemExit(main())
