# Included after each project() of llama.cpp's build (CMAKE_PROJECT_INCLUDE, llama.py): once the whole tree is
# configured, llama.cpp's `common` library and the cpp-httplib it links are compiled at -O0. The tools use them for
# their command lines, chat templates and downloads, none of which runs in a job's hot loop (the model's work is in
# libllama and ggml, still -O3), and they were half the build's CPU: 244 of 515 s on 2 cores at -O3, half that at -O0.
if(NOT QF_CHEAP_COMMON)
    set(QF_CHEAP_COMMON ON)
    function(qf_cheap_common)
        foreach(target llama-common cpp-httplib)
            if(TARGET ${target})
                set_property(TARGET ${target} APPEND PROPERTY COMPILE_OPTIONS "$<$<COMPILE_LANGUAGE:CXX>:-O0>")
            endif()
        endforeach()
    endfunction()
    cmake_language(DEFER DIRECTORY "${CMAKE_SOURCE_DIR}" CALL qf_cheap_common)
endif()
