from zeroshard.cli import main

raise SystemExit(main())
