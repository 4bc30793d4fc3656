from hosted_tinker.cli import main

raise SystemExit(main())
