from fastdata.cli import main

raise SystemExit(main())
