from nopelens.analyses.cli import main

raise SystemExit(main())
