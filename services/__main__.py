from services.cli import main

if __name__ == "__main__":  # not when a tensor-parallel rank's process (spawned) imports this module
    main()
