"""What every sealfl package may use: errors, atomic files, process helpers, durations,
test pause points and the message keys partners and the aggregator share. Imports nothing
else of sealfl."""
