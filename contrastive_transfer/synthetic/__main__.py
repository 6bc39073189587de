from contrastive_transfer.synthetic.generate import main

main()
