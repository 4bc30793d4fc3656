from hosted_tinker.cli import main

if __name__ == "__main__":  # a spawned worker process imports this module too
    raise SystemExit(main())
