from probformer.cli import main

raise SystemExit(main())
