from infersight.agent.cli import main

raise SystemExit(main())
