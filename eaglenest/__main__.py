from eaglenest.cli import main

raise SystemExit(main())
