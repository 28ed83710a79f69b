# Run at every build (cmake -P): writes OUTPUT with the working tree's commit (git describe --dirty)
# only when it changed, so that benchmark records name the code they were built from, not the commit
# of the last configure.
execute_process(COMMAND git -C ${SOURCE_DIR} describe --always --dirty --abbrev=12
                OUTPUT_VARIABLE commit OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
if(commit STREQUAL "")
  set(commit "unknown")
endif()
set(content "#define TWELL_GIT_COMMIT \"${commit}\"\n")
if(EXISTS ${OUTPUT})
  file(READ ${OUTPUT} old)
endif()
if(NOT old STREQUAL content)
  file(WRITE ${OUTPUT} "${content}")
endif()
