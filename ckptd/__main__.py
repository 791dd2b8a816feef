from ckptd.cli import main

raise SystemExit(main())
